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
local r = {1}
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then
  if cur then r = {-1} else r = {0} end
else
  if redis.call('EXISTS', KEYS[2]) == 1 then
    local nxt = live_head(now_ms())
    if nxt then
      redis.call('LPOP', KEYS[2])
      redis.call('HDEL', KEYS[3], nxt)
      redis.call('SET', KEYS[1], nxt, 'PX', ARGV[2])
      r = {2, nxt}
    end
  end
  if r[1] == 1 then
    redis.call('DEL', KEYS[1])
  end
end
if #KEYS >= 4 then
  r[#r + 1] = redis.call('EXISTS', KEYS[4])
end
return r
