#!lua
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- The shebang (Redis 7) declares a script that may write: a read-only replica or a Redis out of
-- memory refuses every call up front, not only the calls that happen to write.
-- The fleet's live workers, for the "local" policy's share while Redis fails (see
-- scrapy_redis_throttle/activity.py): each worker calls this every few seconds; a worker that
-- stops calling drops out once its entry expires.
--
-- KEYS[1]  the fleet's sorted set: worker id -> until when it counts (µs like the bucket's
--          time, see token_bucket.lua)
-- ARGV[1]  the worker's id (not empty)
-- ARGV[2]  how long it counts from now, µs, an integer > 0; 0: it leaves the fleet now
--
-- Returns the number of workers live now (this one included while it counts).

local ttl = tonumber(ARGV[2])
if not ARGV[1] or ARGV[1] == "" or not ttl or ttl < 0 or ttl ~= math.floor(ttl)
    or ttl >= 2 ^ 53 then
  return redis.error_reply("ERR redis_throttle: fleet takes a worker id and a ttl (µs, an "
    .. "integer >= 0), got " .. table.concat(ARGV, " "))
end

local now = server_now()
-- Those whose time ran out leave first (each worker's entry is removed once: bounded work).
redis.call("ZREMRANGEBYSCORE", KEYS[1], "-inf", string.format("%d", now))
if ttl > 0 then
  redis.call("ZADD", KEYS[1], string.format("%d", now + ttl), ARGV[1])
else
  redis.call("ZREM", KEYS[1], ARGV[1])
end
local live = redis.call("ZCARD", KEYS[1])
local last = redis.call("ZRANGE", KEYS[1], -1, -1, "WITHSCORES")[2]
if last then
  redis.call("PEXPIRE", KEYS[1], math.max(1, math.ceil((tonumber(last) - now) / 1000)))
end
return live
