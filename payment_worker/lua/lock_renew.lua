-- lock_renew: the watchdog's owner-checked renewal of the account lock.
--
-- KEYS[1]  the lock ({prefix}:lock:{acct})
-- ARGV[1]  the holder's token
-- ARGV[2]  the lock TTL in ms
--
-- Returns 1 renewed; 0 the key is gone; -1 the key holds another token (never extended).
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if cur then return -1 end
return 0
