-- token_release: release the token refresh lock, only if it is still ours; and, after a
-- refresh that followed a 401 and got no token, drop the refused token from the shared hash
-- (every process would send it again, one 401 each, until a refresh got through).
--
-- KEYS[1]  the refresh lock ({prefix}:token-lock:{acct})
-- KEYS[2]  (optional) the token hash ({prefix}:token:{acct})
-- ARGV[1]  our owner value
-- ARGV[2]  (with KEYS[2]) the token the gateway refused: the hash is deleted only while it
--          still holds that one (a newer token stored meanwhile stays)
--
-- Returns 1 deleted; 0 the lock expired or belongs to another refresher (left alone).
-- #include token_release
local released = token_release(KEYS[1], ARGV[1])
if KEYS[2] and redis.call('HGET', KEYS[2], 'token') == ARGV[2] then
  redis.call('DEL', KEYS[2])
end
return released
