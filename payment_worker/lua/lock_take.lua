-- lock_take: try the account lock without waiting, and record the arriving work in the same
-- step: the holder's "work waiting" mark when the lock is busy, or, when it is taken, the
-- marks cleared (everything announced so far is about to be drained by the taker).
--
-- KEYS[1]  the lock ({prefix}:lock:{acct})
-- KEYS[2]  the mark its holder checks after releasing ({prefix}:waiting:{acct})
-- KEYS[3..] further marks deleted when the lock is taken (the sweeper's, the queued one)
-- ARGV[1]  the taker's token (the lock's value)
-- ARGV[2]  the lock TTL in ms
-- ARGV[3]  the mark's value (the arriving batch id)
-- ARGV[4]  the mark's TTL in ms
--
-- Returns 1 taken (every mark deleted), 0 busy (the mark set). As one script this is the
-- order the drain relies on: a busy lock's holder either finds the mark after it releases,
-- or released before this ran and the lock was taken here.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('DEL', unpack(KEYS, 2))
  return 1
end
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
return 0
