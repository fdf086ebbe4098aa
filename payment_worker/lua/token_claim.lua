-- token_claim: read the account's shared token and, when a new one is needed, take the
-- refresh lock in the same step (one round trip instead of a read, a SET NX and a re-read).
--
-- KEYS[1]  the token hash ({prefix}:token:{acct}; token, lead_ms; its TTL is the token's)
-- KEYS[2]  the refresh lock ({prefix}:token-lock:{acct})
-- ARGV[1]  an owner value for the refresh lock
-- ARGV[2]  the refresh lock's TTL in ms
-- ARGV[3]  a token the gateway just answered 401 to, or '' (none)
--
-- Returns {verdict, token, pttl, lead_ms}; token is '' when there is none (or it expired):
--   'use'      the token is valid, not yet due for refresh, and not the rejected one;
--   'refresh'  the lock is now ours (owner ARGV[1]): fetch a new token; the read and the
--              lock are one step, so no other refresher stored a token in between;
--   'wait'     another process holds the lock: the token, if any, is still valid (it may
--              be due, or the rejected one: the caller decides).
local v = redis.call('HMGET', KEYS[1], 'token', 'lead_ms')
local pttl = redis.call('PTTL', KEYS[1])
local token = v[1]
local lead = tonumber(v[2]) or 0
if not token or pttl <= 0 then
  token = ''
  pttl = 0
end
if token ~= '' and token ~= ARGV[3] and pttl > lead then
  return {'use', token, pttl, lead}
end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', tonumber(ARGV[2])) then
  return {'refresh', token, pttl, lead}
end
return {'wait', token, pttl, lead}
