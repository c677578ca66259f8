#!lua flags=allow-oom
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- The shebang (Redis 7) declares a script that may write: a read-only replica refuses every
-- call up front. It only removes, so a Redis out of memory lets it run, as it lets scrapy-redis
-- pop its queue: parked requests must not be stuck there while the queue goes on.
-- Take the requests that are due (or will be within `ahead`) out of the parking set: each one
-- goes to exactly one caller, since the script runs atomically.
--
-- KEYS[1]  the spider's parking set (see park.lua)
-- KEYS[2]  its index of reserved moments (see park.lua)
-- ARGV[1]  ahead: microseconds; requests due that soon are taken too, >= 0
-- ARGV[2]  limit: the most requests to take, >= 1
-- ARGV[3]  (optional) a member: take out only this one, if it is parked, whenever it is due
--          (a park whose reply was lost must not stay parked: its request waits elsewhere);
--          "": none
-- KEYS[3], KEYS[4], ARGV[4], ARGV[5]  (optional) the worker's leases, the lessees, the worker
--          and how long its leases hold from now (µs, an integer > 0): each request taken out
--          is leased to the worker (see lease_pop.lua), under its member's id
--
-- Returns {parked_left, next_due_ms, now_us, member_1, due_in_ms_1, member_2, due_in_ms_2, ...}:
-- next_due_ms is how long until the next request left is due ("-1" when none is left); now_us
-- is when the script ran, by Redis's clock (µs since 2024-01-01), from when the caller counts
-- the due_in_ms (a reply may be read late); due_in_ms is negative for a request already overdue.

local ahead = tonumber(ARGV[1])
if ahead == nil or ahead ~= ahead or ahead < 0 or ahead == math.huge then
  return redis.error_reply("ERR redis_throttle: ahead must be a finite number >= 0, got "
    .. tostring(ARGV[1]))
end
local limit = tonumber(ARGV[2])
if limit == nil or limit < 1 or limit ~= math.floor(limit) then
  return redis.error_reply("ERR redis_throttle: limit must be an integer >= 1, got "
    .. tostring(ARGV[2]))
end

local ttl = tonumber(ARGV[5] or "1")
if KEYS[4] and (not ARGV[4] or ARGV[4] == "" or not ttl or ttl <= 0 or ttl ~= math.floor(ttl)
    or ttl > MAX_AHEAD) then
  return redis.error_reply("ERR redis_throttle: a lease takes a worker and a ttl in µs (an "
    .. "integer > 0)")
end

local now = server_now()
local due
if ARGV[3] and ARGV[3] ~= "" then
  -- Also under the name void_parked.lua gives it, if a voiding came first.
  due = {}
  for _, member in ipairs({ARGV[3], "a" .. string.sub(ARGV[3], 2)}) do
    local score = redis.call("ZSCORE", KEYS[1], member)
    if score then
      due = {member, score}
    end
  end
else
  due = redis.call("ZRANGEBYSCORE", KEYS[1], "-inf", string.format("%.0f", now + ahead),
    "WITHSCORES", "LIMIT", 0, limit)
end
local reply = {0, "-1", now}
for i = 1, #due, 2 do
  local member, score = due[i], tonumber(due[i + 1])
  redis.call("ZREM", KEYS[1], member)
  -- A reserved moment leaves the index with it (a member not of park.lua's form has none).
  local length = tonumber(string.match(member, "^r" .. string.rep("%x", 32) .. "(%d%d%d%d%d)"))
  if length then
    redis.call("ZREM", KEYS[2], string.sub(member, 34, 38 + length)
      .. string.format("%017.0f", score) .. string.sub(member, 39 + length, 54 + length)
      .. string.sub(member, 2, 33))
  end
  if KEYS[4] then
    redis.call("HSET", KEYS[3], string.sub(member, 2, 33), "p" .. due[i + 1] .. " " .. member)
  end
  reply[#reply + 1] = member
  reply[#reply + 1] = string.format("%.3f", (score - now) / 1000)
end
if KEYS[4] and #due > 0 then
  redis.call("ZADD", KEYS[4], string.format("%d", now + ttl), ARGV[4])
end
local next_due = redis.call("ZRANGE", KEYS[1], 0, 0, "WITHSCORES")
if next_due[2] then
  reply[2] = string.format("%.3f", (tonumber(next_due[2]) - now) / 1000)
end
reply[1] = redis.call("ZCARD", KEYS[1])
return reply
