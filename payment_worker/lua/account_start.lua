-- account_start: the start of a drain in one round trip: the account lock taken as
-- lock_take.lua takes it and, only when it was taken, what the holder's first gateway
-- request would otherwise fetch in two more: the shared token read (with the refresh lock
-- taken when a new token is needed, as token_claim.lua) and a block of pacing slots leased
-- (as pace_acquire.lua).
--
-- KEYS[1]  the lock ({prefix}:lock:{acct})
-- KEYS[2]  the "work waiting" mark ({prefix}:waiting:{acct})
-- KEYS[3]  the token hash ({prefix}:token:{acct})
-- KEYS[4]  the token's refresh lock ({prefix}:token-lock:{acct})
-- KEYS[5]  the pacing state ({prefix}:pace:{acct}; a cooldown there also holds back the
--          token read's refresh, as token_claim.lua's)
-- KEYS[6..] further marks deleted when the lock is taken (the sweeper's, the queued one)
-- ARGV[1]  the taker's token (the lock's value)
-- ARGV[2]  the lock TTL in ms
-- ARGV[3]  the mark's value (the arriving batch id)
-- ARGV[4]  the mark's TTL in ms
-- ARGV[5]  an owner value for the refresh lock, or '' (no token read)
-- ARGV[6]  the refresh lock's TTL in ms
-- ARGV[7]  the pacing rate, requests per second, or '' (no lease)
-- ARGV[8]  the most slots to lease
-- ARGV[9]  how far ahead (ms) the first slot may lie and still be leased now
--
-- Returns {0} busy (the mark set, nothing else read or written), or {1, token, pace}: taken
-- (the marks deleted), `token` token_claim.lua's reply and `pace` pace_acquire.lua's, each
-- an empty array when its part was not asked for. All keys are in the account's slot.
-- #include now_ms
-- #include lock_take
-- #include token_claim
-- #include pace_lease
if lock_take(KEYS[1], ARGV[1], ARGV[2], KEYS[2], ARGV[3], ARGV[4], {unpack(KEYS, 6)}) == 0 then
  return {0}
end
local token = {}
if ARGV[5] ~= '' then
  token = token_claim(KEYS[3], KEYS[4], ARGV[5], tonumber(ARGV[6]), '', KEYS[5])
end
local pace = {}
if ARGV[7] ~= '' then
  pace = pace_lease(KEYS[5], tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]))
end
return {1, token, pace}
