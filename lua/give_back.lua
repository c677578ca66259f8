#!lua
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- The shebang (Redis 7) declares a script that may write: a read-only replica refuses every
-- call up front.
-- Give a worker's leased requests back (see lease_pop.lua): those of the queue to the queue,
-- where they are taken next, those of the parking set to the parking set, due now, to ask for
-- a new moment. Only once the worker's leases expired (it died, or stalled that long), or at the
-- worker's own clean close: exactly once, since the script runs atomically and what it gives
-- back leaves the worker's leases.
--
-- KEYS[1]  the lessees (see lease_pop.lua)
-- KEYS[2]  the worker's leases
-- KEYS[3]  scrapy-redis's queue
-- KEYS[4]  the parking set (see park.lua)
-- ARGV[1]  the worker (not empty)
-- ARGV[2]  the queue's kind: "fifo", "lifo" or "priority"
-- ARGV[3]  "1": the worker's own clean close (its leases need not have expired); else "0"
--
-- Returns {given_back, left}: left is what the worker still holds (another call gives more
-- back); -1 as given_back when the worker's leases hold (it is alive: nothing is done).

local BATCH = 1000
local worker, kind, own = ARGV[1], ARGV[2], ARGV[3] == "1"
if not worker or worker == "" or not (kind == "fifo" or kind == "lifo" or kind == "priority") then
  return redis.error_reply("ERR redis_throttle: give_back takes a worker and a kind (fifo, "
    .. "lifo, priority)")
end
local now = server_now()
local holds = number_read(redis.call("ZSCORE", KEYS[1], worker), math.huge)
if not own and holds and holds >= now then
  return {-1, redis.call("HLEN", KEYS[2])}
end

local given = 0
local page = redis.call("HSCAN", KEYS[2], 0, "COUNT", BATCH)[2]
for i = 1, #page, 2 do
  local origin, score, entry = string.match(page[i + 1], "^([qp])(%S+) (.*)$")
  score = number_read(score, math.huge)
  if origin == "q" and score then
    if kind == "priority" then
      redis.call("ZADD", KEYS[3], string.format("%.17g", score), entry)
    elseif kind == "fifo" then
      redis.call("RPUSH", KEYS[3], entry)
    else
      redis.call("LPUSH", KEYS[3], entry)
    end
    given = given + 1
  elseif origin == "p" and string.find(entry, "^[rua]") then
    -- Due now, to ask for a new moment: the one it held has passed, or was another worker's.
    redis.call("ZADD", KEYS[4], string.format("%d", now), "a" .. string.sub(entry, 2))
    given = given + 1
  end
  -- (A value no script wrote is dropped: it cannot be given back.)
  redis.call("HDEL", KEYS[2], page[i])
end
local left = redis.call("HLEN", KEYS[2])
if left == 0 then
  redis.call("ZREM", KEYS[1], worker)
end
return {given, left}
