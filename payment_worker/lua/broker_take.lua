-- broker_take: kombu's unacked record for the message BRPOP just returned, and up to N more
-- messages popped from the consumer's queues, each recorded in the same step. One round trip
-- for a block of messages where kombu spends two per message (its BRPOP, then its record),
-- which bounded how fast a threads worker's single consumer thread starts accounts.
--
-- KEYS[1]  kombu's unacked hash (delivery tag -> [message, exchange, routing key])
-- KEYS[2]  kombu's unacked index (sorted set: delivery tag, scored by delivery time)
-- KEYS[3..] the queues' lists, in BRPOP's order (the first non-empty one is popped, as BRPOP)
-- ARGV[1]  the delivery time, the client's clock in seconds (the score kombu gives)
-- ARGV[2]  how many more messages to pop (0: only record the first)
-- ARGV[3]  the first message's delivery tag ('' when it has none: nothing is recorded)
-- ARGV[4]  the first message's record, as kombu writes it
--
-- Returns a flat list of (queue key index, recorded 1/0, message) per popped message. A
-- message without a readable delivery tag is returned unrecorded: kombu's own path records it.
if ARGV[3] ~= '' then
  redis.call('ZADD', KEYS[2], ARGV[1], ARGV[3])
  redis.call('HSET', KEYS[1], ARGV[3], ARGV[4])
end
local out = {}
local wanted = tonumber(ARGV[2])
local k = 3
while wanted > 0 and k <= #KEYS do
  local item = redis.call('RPOP', KEYS[k])
  if not item then
    k = k + 1
  else
    wanted = wanted - 1
    local ok, m = pcall(cjson.decode, item)
    local p = ok and type(m) == 'table' and m.properties or nil
    local tag = type(p) == 'table' and p.delivery_tag or nil
    local info = type(p) == 'table' and p.delivery_info or nil
    if type(tag) == 'string' and type(info) == 'table' then
      -- kombu's record is the JSON list [message, exchange, routing_key]: the message is
      -- kept byte for byte (a decode and encode could change it), the two names encoded
      local record = '[' .. item .. ',' .. cjson.encode(info.exchange) .. ','
        .. cjson.encode(info.routing_key) .. ']'
      redis.call('ZADD', KEYS[2], ARGV[1], tag)
      redis.call('HSET', KEYS[1], tag, record)
      out[#out + 1] = k - 2
      out[#out + 1] = 1
    else
      out[#out + 1] = k - 2
      out[#out + 1] = 0
    end
    out[#out + 1] = item
  end
end
return out
