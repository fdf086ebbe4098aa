-- lib/token_claim: read an account's shared token and, when a new one is needed, take the
-- refresh lock in the same step (needs lib/now_ms included before it).
--
-- Defines: token_claim(token_key, lock_key, owner, lock_ttl_ms, rejected, pace_key) ->
-- {verdict, token, pttl, lead_ms, cooling_ms}, as token_claim.lua returns it (see there):
-- 'use', 'refresh' (the lock is now `owner`'s), 'wait' or 'cooling'; token '' when there
-- is none.
local function token_claim(token_key, lock_key, owner, lock_ttl_ms, rejected, pace_key)
  local v = redis.call('HMGET', token_key, 'token', 'lead_ms')
  local pttl = redis.call('PTTL', token_key)
  local token = v[1]
  local lead = tonumber(v[2]) or 0
  if not token or pttl <= 0 then
    token = ''
    pttl = 0
  end
  if token ~= '' and token ~= rejected and pttl > lead then
    return {'use', token, pttl, lead, 0}
  end
  -- the lock already `owner`'s: a retry of a claim whose reply was lost (owners are random
  -- per claim), so the refresh is this caller's to make (first: a cooldown recorded since
  -- would leave the lock held by an owner nobody knows, until its TTL)
  if redis.call('GET', lock_key) == owner then
    return {'refresh', token, pttl, lead, 0}
  end
  -- a 429 (a token request's or a payment's) closed the account for every process: no
  -- token request before its Retry-After is over (the protocol), whichever process asks
  local untl = tonumber(redis.call('HGET', pace_key, 'until')) or 0
  local cooling = untl - now_ms()
  if cooling > 0 then
    return {'cooling', token, pttl, lead, cooling}
  end
  if redis.call('SET', lock_key, owner, 'NX', 'PX', lock_ttl_ms) then
    return {'refresh', token, pttl, lead, 0}
  end
  return {'wait', token, pttl, lead, 0}
end
