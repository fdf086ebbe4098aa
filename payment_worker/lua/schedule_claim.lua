-- schedule_claim: keep the account's one delayed message, and keep the earliest one.
--
-- KEYS[1]  the account's scheduled marker ({prefix}:scheduled:{acct}): a hash with `due`
--          (ms, Redis server clock) and `batch` (the batch id its message carries)
-- ARGV[1]  the new message's delay, ms from now
-- ARGV[2]  the batch id it would carry
-- ARGV[3]  how long the marker outlives its due time, ms
-- ARGV[4]  how much earlier a new message must be due to replace the one on its way, ms
-- ARGV[5]  a value unique to this call: a retry of it (its reply lost) finds its own marker
--          and is answered as the call was, so its message is still published
--
-- Returns {1, due}: the marker now holds this due time, the caller publishes the message
-- (carrying `due`, so that its task clears the marker when it runs); {0, due}: a message
-- due no later (or less than ARGV[4] later) is already on its way (its due time), nothing
-- to publish. A later message is replaced by an earlier one: a retry runs after its own
-- backoff, not after the longest one scheduled before it; two reschedules for the same
-- item, whose delays differ only by measurement noise, publish once. A string marker comes from a version without due times (value:
-- a batch id, expiring 5 s after its message was due).
-- #include now_ms
local now = now_ms()
local due = now + tonumber(ARGV[1])
local kind = redis.call('TYPE', KEYS[1]).ok
local cur = nil
if kind == 'hash' then
  local mine = redis.call('HMGET', KEYS[1], 'due', 'call')
  if mine[2] == ARGV[5] then
    return {1, tonumber(mine[1])}
  end
  cur = tonumber(mine[1])
elseif kind == 'string' then
  local left = redis.call('PTTL', KEYS[1])
  if left >= 0 then cur = now + math.max(left - 5000, 0) end
end
if cur and cur - tonumber(ARGV[4]) < due then
  return {0, cur}
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'due', string.format('%d', due), 'batch', ARGV[2], 'call', ARGV[5])
redis.call('PEXPIREAT', KEYS[1], due + tonumber(ARGV[3]))
return {1, due}
