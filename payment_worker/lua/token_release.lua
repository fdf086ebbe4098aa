-- token_release: release the token refresh lock, only if it is still ours.
--
-- KEYS[1]  the refresh lock ({prefix}:token-lock:{acct})
-- ARGV[1]  our owner value
--
-- Returns 1 deleted; 0 the lock expired or belongs to another refresher (left alone).
-- #include token_release
return token_release(KEYS[1], ARGV[1])
