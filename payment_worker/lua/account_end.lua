-- account_end: the end of a drain in one round trip: what the holder is done with given
-- back, then the account lock released as lock_release.lua releases it, and the "work
-- waiting" mark read. What it gives back, each only when asked: the unused rest of its
-- pacing lease (lib/pace_return) and a token refresh lock its start took and it never
-- used (as token_release.lua). Both are given back whether or not the lock was still ours:
-- each checks its own owner.
--
-- KEYS[1]  the lock ({prefix}:lock:{acct})
-- KEYS[2]  its waiter queue ({prefix}:lock:{acct}:queue)
-- KEYS[3]  its waiter leases ({prefix}:lock:{acct}:waiters)
-- KEYS[4]  the "work waiting" mark ({prefix}:waiting:{acct})
-- KEYS[5]  the pacing state ({prefix}:pace:{acct})
-- KEYS[6]  the token's refresh lock ({prefix}:token-lock:{acct})
-- ARGV[1]  the releasing holder's token
-- ARGV[2]  the lock TTL in ms (given to the waiter the lock is handed to)
-- ARGV[3]  the `tat` the holder's lease left, or '' (nothing to give back)
-- ARGV[4]  the ms from now to the account's next free slot (at least an interval)
-- ARGV[5]  the refresh lock's owner value, or '' (none to release)
--
-- Returns {release, marked, given, freed}: `release` lock_release.lua's reply without the
-- mark ({1}, {2, next}, {0} or {-1}), `marked` 1 when the mark exists, `given` 1 when the
-- lease's rest was given back, `freed` 1 when the refresh lock was released (each 0
-- otherwise). All keys are in the account's slot.
-- #include now_ms
-- #include lock_queue
-- #include lock_release
-- #include pace_return
-- #include token_release
local given = 0
if ARGV[3] ~= '' then
  given = pace_return(KEYS[5], ARGV[3], tonumber(ARGV[4]))
end
local freed = 0
if ARGV[5] ~= '' then
  freed = token_release(KEYS[6], ARGV[5])
end
local r = lock_release(ARGV[1], ARGV[2])
return {r, redis.call('EXISTS', KEYS[4]), given, freed}
