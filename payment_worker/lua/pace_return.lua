-- pace_return: give back the unused rest of a lease when its holder is done with the account.
--
-- KEYS[1]  the account's pacing state ({prefix}:pace:{acct}; hash tat, until)
-- ARGV[1]  the `tat` this process's lease left (as pace_acquire returned it)
-- ARGV[2]  rate, requests per second
--
-- Only if nobody has leased since (`tat` is still the lease's): the first free slot becomes
-- one interval from now, so the next holder of the account, in any process, starts then
-- instead of after the lease's window, and no two requests come closer than an interval.
-- Returns 1 when given back, 0 when another lease followed (nothing to give back).
-- #include now_ms
if redis.call('HGET', KEYS[1], 'tat') ~= ARGV[1] then
  return 0
end
local now = now_ms()
redis.call('HSET', KEYS[1], 'tat', string.format('%.3f', now + 1000 / tonumber(ARGV[2])))
return 1
