-- lib/now_ms: the Redis server's clock in milliseconds.
--
-- Defines: now_ms() -> integer ms since the epoch, from TIME (seconds, microseconds).
-- Every process judges leases, buckets and cooldowns on this one clock, so workers on
-- hosts with skewed clocks agree.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
