-- holders_prune: drop the registry's holders silent for longer than the keep time, on the
-- Redis server's clock (the one holder_register.lua scores them by), and list the rest.
--
-- KEYS[1]  the holder registry ({prefix}:holders)
-- ARGV[1]  the keep time in ms
--
-- Returns the holder ids still registered.
-- #include now_ms
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now_ms() - tonumber(ARGV[1])))
return redis.call('ZRANGE', KEYS[1], 0, -1)
