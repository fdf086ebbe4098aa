-- lib/token_release: release an account's token refresh lock, only if it is still ours.
--
-- Defines: token_release(key, owner) -> 1 deleted, 0 the lock expired or belongs to another
-- refresher (left alone).
local function token_release(key, owner)
  if redis.call('GET', key) == owner then
    return redis.call('DEL', key)
  end
  return 0
end
