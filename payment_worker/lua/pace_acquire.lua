-- pace_acquire: lease a block of request slots of the account, on the server clock.
--
-- KEYS[1]  the account's pacing state ({prefix}:pace:{acct}; hash tat, until)
-- ARGV[1]  rate, requests per second
-- ARGV[2]  the most slots to lease (1: one request)
-- ARGV[3]  how far ahead (ms) the first slot may lie and still be leased now
--
-- Slots are 1/rate apart on one timeline per account, shared by every process: `tat` is
-- the first free slot. A lease takes `n` consecutive slots starting at max(now, tat) (and
-- never before a 429's cooldown has ended plus one interval), so two leases never share a
-- slot and the account never gets more than one request per interval, whoever leased.
-- Returns {n, delay_ms, tat}: `n` slots leased, the first `delay_ms` (a decimal string)
-- from now, the others one interval apart, and the first free slot after them as stored
-- (what pace_return compares to give the rest back); or {0, wait_ms} when the first free
-- slot is further ahead than ARGV[3]: ask again then (a cooldown, or other processes'
-- leases).
-- #include now_ms
local now = now_ms()
local interval = 1000 / tonumber(ARGV[1])
local want = tonumber(ARGV[2])
local ahead = tonumber(ARGV[3])
local v = redis.call('HMGET', KEYS[1], 'tat', 'until')
local start = tonumber(v[1]) or now
local untl = tonumber(v[2]) or 0
if untl > 0 and start < untl + interval then
  start = untl + interval
end
if start < now then start = now end
if start - now > ahead then
  return {0, math.max(1, math.ceil(start - now - ahead))}
end
local tat = start + want * interval
local stored = string.format('%.3f', tat)
redis.call('HSET', KEYS[1], 'tat', stored)
local keep = math.ceil(math.max(tat, untl) - now) + 1000
if redis.call('PTTL', KEYS[1]) < keep then
  redis.call('PEXPIRE', KEYS[1], keep)
end
-- a string: Redis would truncate a fractional number to an integer
return {want, string.format('%.3f', start - now), stored}
