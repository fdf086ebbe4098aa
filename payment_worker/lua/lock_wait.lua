-- lock_wait: one step of a blocking acquire: take or confirm the lock, or queue for it.
--
-- KEYS[1]  the lock ({prefix}:lock:{acct})
-- KEYS[2]  its waiter queue ({prefix}:lock:{acct}:queue)
-- KEYS[3]  its waiter leases ({prefix}:lock:{acct}:waiters)
-- ARGV[1]  the waiter's token
-- ARGV[2]  the lock TTL in ms
-- ARGV[3]  the waiter's lease in ms (it must run this script again before the lease ends)
--
-- Returns 1 when the lock is now ours: it was handed to us (TTL re-armed), or it is free
-- and we are the oldest live waiter (or the queue is empty); we leave the queue. Returns 0
-- otherwise, after (re)joining the queue at the back if absent and refreshing our lease.
-- #include now_ms
-- #include lock_queue
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('LREM', KEYS[2], 1, ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
  return 1
end
local now = now_ms()
local lease = tonumber(ARGV[3])
if redis.call('HSET', KEYS[3], ARGV[1], string.format('%d', now + lease)) == 1 then
  redis.call('RPUSH', KEYS[2], ARGV[1])
end
if not cur and live_head(now) == ARGV[1] then
  redis.call('LPOP', KEYS[2])
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
keep_queue(lease)
return 0
