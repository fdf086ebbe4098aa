-- lock_cancel: a waiter gives up (timeout or error) and leaves the queue.
--
-- KEYS[1]  the lock ({prefix}:lock:{acct})
-- KEYS[2]  its waiter queue ({prefix}:lock:{acct}:queue)
-- KEYS[3]  its waiter leases ({prefix}:lock:{acct}:waiters)
-- ARGV[1]  the waiter's token
-- ARGV[2]  the lock TTL in ms
--
-- Returns 1 when the lock was handed to us meanwhile (its TTL re-armed: it is ours to keep
-- or to release), else 0.
redis.call('LREM', KEYS[2], 1, ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
