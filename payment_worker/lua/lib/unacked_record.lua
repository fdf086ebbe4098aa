-- lib/unacked_record: kombu's unacked record of a message, as its Redis QoS writes it.
--
-- Defines: unacked_record(item, hash, index, now) -> the delivery tag, recorded; 0 not (no
-- readable delivery tag or delivery info: kombu's own path records such a message). The record is
-- the JSON list [message, exchange, routing_key] in the hash under the delivery tag, and
-- the tag in the index scored by the delivery time. The message is kept byte for byte (a
-- decode and encode could change it); only the two names are encoded.
local function unacked_record(item, hash, index, now)
  local ok, m = pcall(cjson.decode, item)
  local p = ok and type(m) == 'table' and m.properties or nil
  local tag = type(p) == 'table' and p.delivery_tag or nil
  local info = type(p) == 'table' and p.delivery_info or nil
  if type(tag) ~= 'string' or type(info) ~= 'table' then
    return 0
  end
  local names = cjson.encode(info.exchange) .. ',' .. cjson.encode(info.routing_key)
  redis.call('ZADD', index, now, tag)
  redis.call('HSET', hash, tag, '[' .. item .. ',' .. names .. ']')
  return tag
end
