-- lib/token_claim: read an account's shared token and, when a new one is needed, take the
-- refresh lock in the same step.
--
-- Defines: token_claim(token_key, lock_key, owner, lock_ttl_ms, rejected) ->
-- {verdict, token, pttl, lead_ms}, as token_claim.lua returns it (see there): 'use',
-- 'refresh' (the lock is now `owner`'s) or 'wait'; token '' when there is none.
local function token_claim(token_key, lock_key, owner, lock_ttl_ms, rejected)
  local v = redis.call('HMGET', token_key, 'token', 'lead_ms')
  local pttl = redis.call('PTTL', token_key)
  local token = v[1]
  local lead = tonumber(v[2]) or 0
  if not token or pttl <= 0 then
    token = ''
    pttl = 0
  end
  if token ~= '' and token ~= rejected and pttl > lead then
    return {'use', token, pttl, lead}
  end
  -- the lock already `owner`'s: a retry of a claim whose reply was lost (owners are random
  -- per claim), so the refresh is this caller's to make
  if redis.call('SET', lock_key, owner, 'NX', 'PX', lock_ttl_ms)
      or redis.call('GET', lock_key) == owner then
    return {'refresh', token, pttl, lead}
  end
  return {'wait', token, pttl, lead}
end
