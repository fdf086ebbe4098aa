-- lock_takeover: take (or clear) an account lock whose holder process is no longer alive.
--
-- KEYS[1]  the lock ({prefix}:lock:{acct})
-- ARGV[1]  the lock value the caller read and judged dead (`<holder>:<token>`)
-- ARGV[2]  the new value (`<holder>:<token>` of the taker), or '' to delete the lock
-- ARGV[3]  the lock TTL in ms (for a new value)
--
-- Returns 1 when the lock still held exactly ARGV[1] and now holds ARGV[2] (or is gone),
-- or already holds ARGV[2]: this very takeover ran and its reply was lost (the client's
-- retry; a taker's value is unique to one acquisition), or, to delete, finds no lock at all:
-- the account is free as asked (this delete ran and its reply was lost, or the lock expired
-- or was released meanwhile; a repair message then costs at most one idle run); 0 when it
-- holds another value (handed over, taken by someone else): untouched.
-- The holder's liveness key lives in another Redis Cluster slot, so the caller checks it
-- with a separate read before; the exact value compare makes that safe (docs/locks.md).
local current = redis.call('GET', KEYS[1])
if ARGV[2] ~= '' and current == ARGV[2] then
  return 1
end
if current ~= ARGV[1] then
  if ARGV[2] == '' and not current then
    return 1
  end
  return 0
end
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return 1
