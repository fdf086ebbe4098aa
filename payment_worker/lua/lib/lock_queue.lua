-- lib/lock_queue: the account lock's FIFO of blocking waiters.
--
-- Expects the lock scripts' KEYS: KEYS[2] the waiter queue (list of tokens, oldest first),
-- KEYS[3] the waiter leases (hash token -> lease expiry in Redis server ms).
-- Defines:
--   live_head(now) -> the oldest waiter whose lease has not run out, or false; waiters
--     whose lease ran out (killed, paused) are dropped from the head on the way.
--   keep_queue(ms) -> raises the TTL of the queue and the leases to at least ms, so both
--     expire on their own once no waiter refreshes them.
local function live_head(now)
  while true do
    local head = redis.call('LINDEX', KEYS[2], 0)
    if not head then return false end
    local lease = tonumber(redis.call('HGET', KEYS[3], head) or '0')
    if lease >= now then return head end
    redis.call('LPOP', KEYS[2])
    redis.call('HDEL', KEYS[3], head)
  end
end
local function keep_queue(ms)
  for i = 2, 3 do
    if redis.call('PTTL', KEYS[i]) < ms then redis.call('PEXPIRE', KEYS[i], ms) end
  end
end
