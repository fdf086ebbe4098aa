-- lib/lock_release: give an account lock back if the caller still owns it, or hand it
-- straight to the oldest live waiter (needs lib/now_ms and lib/lock_queue included before
-- it).
--
-- Expects the lock scripts' KEYS (as lib/lock_queue): KEYS[1] the lock, KEYS[2] its waiter
-- queue, KEYS[3] its waiter leases.
-- Defines: lock_release(token, ttl_ms) -> {1} released (key deleted), {2, next} handed to
-- waiter token `next` with ttl_ms (the caller wakes it), {0} the key was gone, {-1} the key
-- holds another token; nothing changes in the last two cases (a lock that is not ours is
-- never touched).
local function lock_release(token, ttl_ms)
  local cur = redis.call('GET', KEYS[1])
  if cur ~= token then
    if cur then return {-1} end
    return {0}
  end
  if redis.call('EXISTS', KEYS[2]) == 1 then
    local nxt = live_head(now_ms())
    if nxt then
      redis.call('LPOP', KEYS[2])
      redis.call('HDEL', KEYS[3], nxt)
      redis.call('SET', KEYS[1], nxt, 'PX', ttl_ms)
      return {2, nxt}
    end
  end
  redis.call('DEL', KEYS[1])
  return {1}
end
