-- schedule_clear: a delayed message has arrived; forget the marker if it is still its own.
--
-- KEYS[1]  the account's scheduled marker ({prefix}:scheduled:{acct})
-- ARGV[1]  the due time the message carries (ms, as schedule_claim returned it)
--
-- Returns 1 cleared; 0 the marker is gone or belongs to another message (an earlier one
-- replaced it, or a later one was scheduled after it was cleared): left alone.
if redis.call('TYPE', KEYS[1]).ok == 'hash' and redis.call('HGET', KEYS[1], 'due') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
