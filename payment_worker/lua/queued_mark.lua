-- queued_mark: note that a message for the account is being published, stamped with the Redis
-- server's clock: the sweeper reads the stamp against that same clock, so a publisher whose
-- own clock is ahead or behind cannot make a lost message look on its way for long.
--
-- KEYS[1]  the account's queued mark ({prefix}:queued:{acct})
-- ARGV[1]  its lifetime, ms
--
-- Returns the stamp (ms since the epoch, Redis server time), which the message's
-- enqueued-at header carries too.
-- #include now_ms
local now = now_ms()
redis.call('SET', KEYS[1], now, 'PX', ARGV[1])
return now
