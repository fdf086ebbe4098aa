-- lib/pace_return: give back the unused rest of a pacing lease (see pace_return.lua; needs
-- lib/now_ms included before it).
--
-- Defines: pace_return(key, tat, rate) -> 1 given back (the first free slot is now one
-- interval from now), 0 another lease followed (`tat` is no longer the lease's).
local function pace_return(key, tat, rate)
  if redis.call('HGET', key, 'tat') ~= tat then
    return 0
  end
  redis.call('HSET', key, 'tat', string.format('%.3f', now_ms() + 1000 / rate))
  return 1
end
