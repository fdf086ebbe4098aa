-- lib/lock_take: try an account lock without waiting, and record the arriving work in the
-- same step (see lock_take.lua for the order this keeps).
--
-- Defines: lock_take(lock_key, value, ttl_ms, mark_key, mark_value, mark_ttl_ms, cleared)
-- -> 1 taken (the mark and the keys of the table `cleared` deleted), 0 busy (the mark set).
-- A lock that already holds `value` is taken too: the value is unique to one acquisition,
-- so this is the client's retry of a take whose reply was lost.
local function lock_take(lock_key, value, ttl_ms, mark_key, mark_value, mark_ttl_ms, cleared)
  if redis.call('SET', lock_key, value, 'NX', 'PX', ttl_ms)
      or redis.call('GET', lock_key) == value then
    redis.call('DEL', mark_key, unpack(cleared))
    return 1
  end
  redis.call('SET', mark_key, mark_value, 'PX', mark_ttl_ms)
  return 0
end
