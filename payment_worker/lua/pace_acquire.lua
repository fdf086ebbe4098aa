-- pace_acquire: take one request slot from the account's token bucket, on the server clock.
--
-- KEYS[1]  the bucket ({prefix}:pace:{acct}; hash tokens, ts, until)
-- ARGV[1]  rate, requests per second
-- ARGV[2]  burst, tokens
--
-- Returns 0 when a slot was taken, else the milliseconds to wait before asking again
-- (until a 429's cooldown ends, or until the next token).
-- #include now_ms
local now = now_ms()
local rate = tonumber(ARGV[1]) / 1000
local burst = tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts', 'until')
local tokens = tonumber(v[1]) or burst
local ts = tonumber(v[2]) or now
local untl = tonumber(v[3]) or 0
if now < untl then
  return untl - now
end
if now > ts then
  tokens = math.min(burst, tokens + (now - ts) * rate)
  ts = now
end
local ttl = math.ceil(burst / rate) + 1000
if tokens >= 1 then
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'ts', tostring(ts))
  redis.call('PEXPIRE', KEYS[1], ttl)
  return 0
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(ts))
redis.call('PEXPIRE', KEYS[1], ttl)
return math.max(1, math.ceil((1 - tokens) / rate))
