-- lib/pace_lease: lease a block of an account's request slots, on the server clock (needs
-- lib/now_ms included before it).
--
-- Defines: pace_lease(key, rate, want, ahead_ms) -> {n, delay_ms, tat} or {0, wait_ms,
-- open_ms}, as pace_acquire.lua returns it (see there for the timeline's rules).
local function pace_lease(key, rate, want, ahead_ms)
  local now = now_ms()
  local interval = 1000 / rate
  local v = redis.call('HMGET', key, 'tat', 'until')
  local start = tonumber(v[1]) or now
  local untl = tonumber(v[2]) or 0
  if untl > 0 and start < untl + interval then
    start = untl + interval
  end
  if start < now then start = now end
  if start - now > ahead_ms then
    return {0, math.max(1, math.ceil(start - now - ahead_ms)), math.ceil(start - now)}
  end
  local tat = start + want * interval
  local stored = string.format('%.3f', tat)
  redis.call('HSET', key, 'tat', stored)
  local keep = math.ceil(math.max(tat, untl) - now) + 1000
  if redis.call('PTTL', key) < keep then
    redis.call('PEXPIRE', key, keep)
  end
  -- a string: Redis would truncate a fractional number to an integer
  return {want, string.format('%.3f', start - now), stored}
end
