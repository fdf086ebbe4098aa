-- pace_cooldown: close the account's bucket for a 429's Retry-After, in every process.
--
-- KEYS[1]  the bucket ({prefix}:pace:{acct}; hash tokens, ts, until)
-- ARGV[1]  the cooldown in ms
--
-- Returns the milliseconds until the account opens again. A cooldown is never shortened,
-- and the bucket restarts empty when it ends, so the first request after it goes at
-- `until` + one interval, never earlier.
-- #include now_ms
local now = now_ms()
local untl = now + tonumber(ARGV[1])
local old = tonumber(redis.call('HGET', KEYS[1], 'until')) or 0
if old > untl then untl = old end
redis.call('HSET', KEYS[1], 'until', tostring(untl), 'tokens', '0', 'ts', tostring(untl))
redis.call('PEXPIRE', KEYS[1], (untl - now) + 60000)
return untl - now
