-- token_store: write a freshly fetched access token, only while we hold the refresh lock,
-- so a refresher whose lock expired cannot overwrite a newer token; the lock is released
-- in the same step once the token is stored.
--
-- KEYS[1]  the refresh lock ({prefix}:token-lock:{acct})
-- KEYS[2]  the token hash ({prefix}:token:{acct})
-- ARGV[1]  our owner value of the refresh lock
-- ARGV[2]  the token
-- ARGV[3]  lead_ms: refresh once the remaining lifetime drops below this
-- ARGV[4]  ttl_ms: the token's remaining lifetime (the hash's TTL)
--
-- Returns 1 stored (and the lock released); 0 not stored (the lock is not ours, or the
-- token already expired: the lock, if ours, is left to token_release).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local ttl = tonumber(ARGV[4])
if ttl <= 0 then
  return 0
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'token', ARGV[2], 'lead_ms', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('DEL', KEYS[1])
return 1
