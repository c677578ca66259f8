#!lua
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- The shebang (Redis 7) declares a script that may write: a read-only replica or a Redis out of
-- memory refuses every call up front, not only the calls that happen to write.
-- Park a request until a moment in Redis server time, in a sorted set shared by the fleet.
--
-- KEYS[1]  the spider's parking set (score: when the request is due, in microseconds since
--          2024-01-01 by Redis's clock; member: ARGV[2])
-- KEYS[2]  its index of reserved moments, for the voidings (see void_parked.lua): all with
--          score 0, "<key length, 5 digits><throttle key><due, 17 digits><reserved_at, 16
--          digits><id>", so that one throttle key's moments are one range, in order
-- ARGV[1]  delay: microseconds from now until the request is due, >= 0
-- ARGV[2]  the member: "<r|u><id, 32 hex digits><key length, 5 digits><throttle key>
--          <reserved_at, 16 digits><serialized request>". r: the request's moment is reserved
--          (at reserved_at, µs by the parking worker's wall clock); u: it asks again when due.
-- ARGV[3]  (optional) Redis's time (µs since 2024-01-01) when the caller counted the delay
--          from, as late as the caller's bounds of Redis's clock allow. A call that waited its
--          turn (behind the others of its connection, whose replies a busy worker reads late)
--          counts the delay from then: from up to WAITED_AT_MOST µs before now, never from
--          later than now.
--
-- Returns the number of requests parked.

local delay = tonumber(ARGV[1])
if delay == nil or delay ~= delay or delay < 0 or delay == math.huge then
  return redis.error_reply("ERR redis_throttle: delay must be a finite number >= 0, got "
    .. tostring(ARGV[1]))
end
local asked = tonumber(ARGV[3] or "0")
if asked == nil or asked ~= asked or asked == math.huge or asked == -math.huge then
  return redis.error_reply("ERR redis_throttle: asked must be a finite number, got "
    .. tostring(ARGV[3]))
end
local member = ARGV[2] or ""
local length = tonumber(string.match(member, "^[ru]" .. string.rep("%x", 32) .. "(%d%d%d%d%d)"))
if not length or not string.find(string.sub(member, 39 + length, 54 + length), "^%d+$")
    or #member <= 54 + length then
  return redis.error_reply("ERR redis_throttle: not a parked request: " .. string.sub(member, 1, 64))
end

local now = server_now()
-- An estimate far off (a clock stepped) moves the moment by WAITED_AT_MOST at most.
local WAITED_AT_MOST = 100000
local from = now
if ARGV[3] and asked < now then
  from = math.max(asked, now - WAITED_AT_MOST)
end
-- 17 digits, for the index's order: at most ~3,000 years from 2024 (the largest double below
-- 1e17: 99999999999999999 is rounded to 1e17, 18 digits).
local due = string.format("%017.0f", math.min(math.max(from + delay, 0), 99999999999999984))
redis.call("ZADD", KEYS[1], due, member)
if string.sub(member, 1, 1) == "r" then
  redis.call("ZADD", KEYS[2], 0, string.sub(member, 34, 38 + length) .. due
    .. string.sub(member, 39 + length, 54 + length) .. string.sub(member, 2, 33))
end
return redis.call("ZCARD", KEYS[1])
