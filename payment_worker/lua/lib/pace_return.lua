-- lib/pace_return: give back the unused rest of a pacing lease when its holder is done with
-- the account (needs lib/now_ms included before it). Only if nobody has leased since (`tat`
-- is still the one the lease left, as pace_acquire returned it): the first free slot becomes
-- `free_ms` from now, so the next holder, in any process, starts then instead of after the
-- lease's window. The holder reckons `free_ms` from its own last requests (at least one
-- interval, and more when its last second of requests leaves no room yet:
-- gateway/pacing_lease.py's next_free), so the two holders' requests together keep the quota.
--
-- A key gone (it expires a second after its last leased slot, while a lock holder went on
-- past its lease on its own spacing) means nobody leased since either: the slot is set all
-- the same (a later first free slot is always safe), with the key kept past it.
--
-- Defines: pace_return(key, tat, free_ms) -> 1 given back, 0 another lease followed
-- (nothing to give back).
local function pace_return(key, tat, free_ms)
  local cur = redis.call('HGET', key, 'tat')
  if cur and cur ~= tat then
    return 0
  end
  redis.call('HSET', key, 'tat', string.format('%.3f', now_ms() + free_ms))
  local keep = math.ceil(free_ms) + 1000
  if redis.call('PTTL', key) < keep then
    redis.call('PEXPIRE', key, keep)
  end
  return 1
end
