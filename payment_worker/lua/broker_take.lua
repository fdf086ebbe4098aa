-- broker_take: kombu's unacked record for the message BRPOP just returned, and up to N more
-- messages popped from the consumer's queues, each recorded in the same step. One round trip
-- for a block of messages where kombu spends two per message (its BRPOP, then its record),
-- which bounded how fast a threads worker's single consumer thread starts accounts.
--
-- KEYS[1]  kombu's unacked hash (delivery tag -> [message, exchange, routing key])
-- KEYS[2]  kombu's unacked index (sorted set: delivery tag, scored by delivery time)
-- KEYS[3..] the queues' lists, in the order of kombu's round robin over the consumer's queues
--          at this wake-up, by priority step (popped in that order: each list until it is
--          empty, then the next, as BRPOP picks the first non-empty one)
-- ARGV[1]  the delivery time, the client's clock in seconds (the score kombu gives)
-- ARGV[2]  how many more messages to pop (0: only record the first)
-- ARGV[3]  the message BRPOP returned, as it came
--
-- Returns the first message's delivery tag if it was recorded (else 0), then a flat list of
-- (queue key index, delivery tag recorded or 0, message) per popped message. A message
-- without a readable delivery tag is left unrecorded: kombu's own path records it
-- (lib/unacked_record).

-- #include unacked_record

local out = {unacked_record(ARGV[3], KEYS[1], KEYS[2], ARGV[1])}
local wanted = tonumber(ARGV[2])
local k = 3
while wanted > 0 and k <= #KEYS do
  local item = redis.call('RPOP', KEYS[k])
  if not item then
    k = k + 1
  else
    wanted = wanted - 1
    out[#out + 1] = k - 2
    out[#out + 1] = unacked_record(item, KEYS[1], KEYS[2], ARGV[1])
    out[#out + 1] = item
  end
end
return out
