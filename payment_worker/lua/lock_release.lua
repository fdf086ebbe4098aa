-- lock_release: give the account lock back, or hand it straight to the oldest live waiter.
--
-- KEYS[1]  the lock ({prefix}:lock:{acct})
-- KEYS[2]  its waiter queue ({prefix}:lock:{acct}:queue)
-- KEYS[3]  its waiter leases ({prefix}:lock:{acct}:waiters)
-- KEYS[4]  optional: the "work waiting" mark ({prefix}:waiting:{acct}), read after the release
-- ARGV[1]  the releasing holder's token
-- ARGV[2]  the lock TTL in ms (given to the waiter the lock is handed to)
--
-- Returns {1} released (key deleted); {2, next} handed to waiter token `next`, which the
-- caller then wakes; {0} the key was gone; {-1} the key holds another token. Nothing
-- changes in the last two cases: a lock that is not ours is never touched. With KEYS[4],
-- each reply ends with 1 when the mark exists (work arrived while the lock was held), else 0.
-- #include now_ms
-- #include lock_queue
-- #include lock_release
local r = lock_release(ARGV[1], ARGV[2])
if #KEYS >= 4 then
  r[#r + 1] = redis.call('EXISTS', KEYS[4])
end
return r
