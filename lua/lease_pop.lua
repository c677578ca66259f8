#!lua
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- The shebang (Redis 7) declares a script that may write: a read-only replica refuses every
-- call up front.
-- Take the next request of scrapy-redis's queue, leased to a worker: it moves to the worker's
-- leases, still in Redis, until the worker acknowledges it (renew_leases.lua) or, when the
-- worker stops renewing its leases, another worker gives it back (give_back.lua).
--
-- KEYS[1]  scrapy-redis's queue: a list (fifo: pushed left, taken right; lifo: taken left) or a
--          sorted set (priority: the lowest score first)
-- KEYS[2]  the worker's leases: a hash, lease id -> "<origin><score> <entry>", origin "q" (the
--          queue) or "p" (the parking set, see unpark.lua)
-- KEYS[3]  the lessees: a sorted set, worker -> until when its leases hold (µs like the
--          bucket's time)
-- ARGV[1]  the queue's kind: "fifo", "lifo" or "priority"
-- ARGV[2]  the worker (not empty)
-- ARGV[3]  the lease's id (not empty)
-- ARGV[4]  how long the worker's leases hold from now, µs, an integer > 0
--
-- Returns the entry, or false when the queue is empty.

local kind, worker, id, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
if not (kind == "fifo" or kind == "lifo" or kind == "priority") or not worker or worker == ""
    or not id or id == "" or not ttl or ttl <= 0 or ttl ~= math.floor(ttl) or ttl > MAX_AHEAD then
  return redis.error_reply("ERR redis_throttle: lease_pop takes a kind (fifo, lifo, priority), "
    .. "a worker, a lease id and a ttl in µs (an integer > 0)")
end

local entry, score = nil, "0"
if kind == "priority" then
  local first = redis.call("ZRANGE", KEYS[1], 0, 0, "WITHSCORES")
  if first[1] then
    entry, score = first[1], first[2]
    redis.call("ZREM", KEYS[1], entry)
  end
elseif kind == "fifo" then
  entry = redis.call("RPOP", KEYS[1])
else
  entry = redis.call("LPOP", KEYS[1])
end
if not entry then
  return false
end
redis.call("HSET", KEYS[2], id, "q" .. score .. " " .. entry)
redis.call("ZADD", KEYS[3], string.format("%d", server_now() + ttl), worker)
return entry
