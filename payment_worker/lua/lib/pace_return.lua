-- lib/pace_return: give back the unused rest of a pacing lease when its holder is done with
-- the account (needs lib/now_ms included before it). Only if nobody has leased since (`tat`
-- is still the one the lease left, as pace_acquire returned it): the first free slot becomes
-- one interval from now, so the next holder, in any process, starts then instead of after
-- the lease's window, and no two requests come closer than an interval.
--
-- A key gone (it expires a second after its last leased slot, while a lock holder went on
-- past its lease on its own spacing) means nobody leased since either: the slot is set all
-- the same (a later first free slot is always safe), with the key kept past it.
--
-- Defines: pace_return(key, tat, rate) -> 1 given back, 0 another lease followed (nothing
-- to give back).
local function pace_return(key, tat, rate)
  local cur = redis.call('HGET', key, 'tat')
  if cur and cur ~= tat then
    return 0
  end
  local interval = 1000 / rate
  redis.call('HSET', key, 'tat', string.format('%.3f', now_ms() + interval))
  local keep = math.ceil(interval) + 1000
  if redis.call('PTTL', key) < keep then
    redis.call('PEXPIRE', key, keep)
  end
  return 1
end
