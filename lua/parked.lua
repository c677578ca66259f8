#!lua
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- The fleet's parked requests per throttle key, for `scrapy-redis-throttle status` (see
-- scrapy_redis_throttle/activity.py): each worker sends how many it parked (+) and took back
-- (-) per key since its last report; a request may come back to another worker than the one
-- that parked it. A key whose count comes back to 0 leaves the hash, which thus holds only the
-- keys with requests parked (one below 0 for a while was taken back before its park came in).
--
-- KEYS[1]  the hash: throttle key -> requests parked
-- ARGV[1]  the hash's expiry, milliseconds, an integer > 0: a fleet idle that long leaves
--          nothing behind (not even what a worker killed before its report left)
-- ARGV[2], ARGV[3], ...  pairs: a throttle key, the change of its count (an integer)
--
-- Returns the number of keys changed.

local expiry = tonumber(ARGV[1])
local valid = expiry and expiry > 0 and expiry == math.floor(expiry) and #ARGV % 2 == 1
for index = 3, #ARGV, 2 do
  local change = tonumber(ARGV[index])
  valid = valid and change and change == math.floor(change) and math.abs(change) < 2 ^ 53
end
if not valid then
  return redis.error_reply("ERR redis_throttle: parked takes an expiry (ms, an integer > 0) "
    .. "and pairs of a key and an integer change, got " .. table.concat(ARGV, " "))
end

for index = 2, #ARGV, 2 do
  if redis.call("HINCRBY", KEYS[1], ARGV[index], ARGV[index + 1]) == 0 then
    redis.call("HDEL", KEYS[1], ARGV[index])
  end
end
redis.call("PEXPIRE", KEYS[1], expiry)
return (#ARGV - 1) / 2
