-- lib/pace_return: give back the unused rest of a pacing lease when its holder is done with
-- the account (needs lib/now_ms included before it). Only if nobody has leased since (`tat`
-- is still the one the lease left, as pace_acquire returned it): the first free slot becomes
-- one interval from now, so the next holder, in any process, starts then instead of after
-- the lease's window, and no two requests come closer than an interval.
--
-- Defines: pace_return(key, tat, rate) -> 1 given back, 0 another lease followed (nothing
-- to give back).
local function pace_return(key, tat, rate)
  if redis.call('HGET', key, 'tat') ~= tat then
    return 0
  end
  redis.call('HSET', key, 'tat', string.format('%.3f', now_ms() + 1000 / rate))
  return 1
end
