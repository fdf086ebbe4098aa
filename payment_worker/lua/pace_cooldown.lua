-- pace_cooldown: close the account's pacing for a 429's Retry-After, in every process.
--
-- KEYS[1]  the account's pacing state ({prefix}:pace:{acct}; hash tat, until)
-- ARGV[1]  the cooldown in ms
--
-- Returns the milliseconds until the account opens again. A cooldown is never shortened,
-- and pace_acquire leases no slot before `until` + one interval, so the first request
-- after it goes then, never earlier. Slots already leased by a process are not recalled:
-- a process drops its own lease when it records a cooldown; another one's runs out with
-- its window (at most GATEWAY_PACING_LEASE_SECONDS), and a lock holder past its lease does
-- not read this again before its drain ends.
-- #include now_ms
local now = now_ms()
local untl = now + tonumber(ARGV[1])
local old = tonumber(redis.call('HGET', KEYS[1], 'until')) or 0
if old > untl then untl = old end
redis.call('HSET', KEYS[1], 'until', tostring(untl))
redis.call('PEXPIRE', KEYS[1], (untl - now) + 60000)
return untl - now
