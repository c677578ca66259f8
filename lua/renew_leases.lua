#!lua
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- The shebang (Redis 7) declares a script that may write: a read-only replica refuses every
-- call up front. It mostly removes, so a Redis out of memory lets it run.
-- A worker acknowledges the requests it is done with (their leases go) and renews the others
-- (see lease_pop.lua), in one call.
--
-- KEYS[1]  the worker's leases (see lease_pop.lua)
-- KEYS[2]  the lessees (see lease_pop.lua)
-- ARGV[1]  the worker (not empty)
-- ARGV[2]  how long its leases hold from now, µs, an integer > 0; 0: the worker leaves (a
--          clean close: it holds no lease any more)
-- ARGV[3..] the ids of the leases acknowledged, at most MAX_ACKS
--
-- Returns the number of leases the worker still holds.

local MAX_ACKS = 1000
local worker, ttl = ARGV[1], tonumber(ARGV[2])
if not worker or worker == "" or not ttl or ttl < 0 or ttl ~= math.floor(ttl) or ttl > MAX_AHEAD
    or #ARGV > MAX_ACKS + 2 then
  return redis.error_reply("ERR redis_throttle: renew_leases takes a worker, a ttl in µs (an "
    .. "integer >= 0) and at most " .. MAX_ACKS .. " lease ids")
end
if #ARGV > 2 then
  redis.call("HDEL", KEYS[1], unpack(ARGV, 3))
end
local held = redis.call("HLEN", KEYS[1])
if ttl > 0 then
  redis.call("ZADD", KEYS[2], string.format("%d", server_now() + ttl), worker)
elseif held == 0 then
  redis.call("ZREM", KEYS[2], worker)
end
return held
