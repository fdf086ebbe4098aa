-- holder_register: put a lock holder in the registry, scored on the Redis server's clock,
-- so a sweeper on another host prunes it on the same clock (a host's own clock behind
-- by more than the keep time had its holders pruned on every pass, unseen when they died).
--
-- KEYS[1]  the holder registry ({prefix}:holders; a sorted set, score = last beat, ms)
-- ARGV[1]  the holder id
--
-- Returns the score written.
-- #include now_ms
local now = now_ms()
redis.call('ZADD', KEYS[1], now, ARGV[1])
return now
