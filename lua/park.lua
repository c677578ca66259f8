#!lua
-- The shebang (Redis 7) declares a script that may write: a read-only replica or a Redis out of
-- memory refuses every call up front, not only the calls that happen to write.
-- Park a request until a moment in Redis server time, in a sorted set shared by the fleet.
--
-- KEYS[1]  the spider's parking set (score: when the request is due, in microseconds since
--          2024-01-01 by Redis's clock; member: a unique id followed by the serialized request)
-- ARGV[1]  delay: microseconds from now until the request is due, >= 0
-- ARGV[2]  the member
--
-- Returns the number of requests parked.

local delay = tonumber(ARGV[1])
if delay == nil or delay ~= delay or delay < 0 or delay == math.huge then
  return redis.error_reply("ERR redis_throttle: delay must be a finite number >= 0, got "
    .. tostring(ARGV[1]))
end
if ARGV[2] == nil or ARGV[2] == "" then
  return redis.error_reply("ERR redis_throttle: no request to park")
end

local time = redis.call("TIME")
local now = (tonumber(time[1]) - 1704067200) * 1000000 + tonumber(time[2])
redis.call("ZADD", KEYS[1], string.format("%.0f", now + delay), ARGV[2])
return redis.call("ZCARD", KEYS[1])
