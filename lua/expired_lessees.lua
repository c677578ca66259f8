#!lua flags=no-writes
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- The workers whose leases expired (see lease_pop.lua): they stopped renewing them.
--
-- KEYS[1]  the lessees (see lease_pop.lua)
-- ARGV[1]  the most workers to return, an integer >= 1
--
-- Returns the workers whose leases expired, at most ARGV[1].

local most = tonumber(ARGV[1])
if not most or most < 1 or most ~= math.floor(most) then
  return redis.error_reply("ERR redis_throttle: expired_lessees takes a count >= 1, got "
    .. tostring(ARGV[1]))
end
return redis.call("ZRANGEBYSCORE", KEYS[1], "-inf", string.format("(%d", server_now()),
  "LIMIT", 0, most)
