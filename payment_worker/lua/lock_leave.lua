-- lock_leave: a waiter or a taker that gives up after an error leaves the queue, and gives
-- back the lock if it holds it (handed over meanwhile, or taken by a take whose reply was
-- lost), in one step: a place left in the queue would be handed the lock later, and nobody
-- would take it up before its TTL.
--
-- KEYS[1]  the lock ({prefix}:lock:{acct})
-- KEYS[2]  its waiter queue ({prefix}:lock:{acct}:queue)
-- KEYS[3]  its waiter leases ({prefix}:lock:{acct}:waiters)
-- ARGV[1]  the token
-- ARGV[2]  the lock TTL in ms (given to the waiter the lock is handed to)
--
-- Returns lock_release's reply: {1} released, {2, next} handed to waiter `next` (the caller
-- wakes it), {0} the key was gone, {-1} the key holds another token (not touched). Run
-- again after a lost reply it changes nothing more.
-- #include now_ms
-- #include lock_queue
-- #include lock_release
redis.call('LREM', KEYS[2], 1, ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return lock_release(ARGV[1], ARGV[2])
