#!lua flags=allow-oom
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- The shebang (Redis 7) declares a script that may write. It adds no memory (each member it
-- takes out of the index comes back as one of the same size), so a Redis out of memory lets it
-- run, as it lets unpark.lua.
-- A voiding (a pause, a decrease of the adaptive rate, a limit changed live: see
-- scrapy_redis_throttle/penalties.py) reaches the requests parked with a moment it voids: they
-- become due now and marked to ask Redis again ("a"), instead of waiting for their old moments
-- to learn it, in the order of their moments (each scored as much earlier as until is ahead).
-- Every worker that hears a voiding calls this; the first does the work.
--
-- KEYS[1]  the spider's parking set (see park.lua)
-- KEYS[2]  its index of reserved moments (see park.lua)
-- ARGV[1]  the throttle key
-- ARGV[2]  until: µs from now; the voided moments are those up to then...
-- ARGV[3]  ...reserved before this wall time (µs, an integer: it is compared with the parking
--          workers' reserved_at, so the caller allows for their clocks)
-- ARGV[4]  "", or the last index entry the previous call looked at: go on after it
-- ARGV[5]  limit: the most index entries to look at, an integer >= 1
--
-- Returns {released, last}: how many requests became due now, and the last index entry looked
-- at, for the next call ("" when there is nothing more to look at).

local key, after = ARGV[1] or "", ARGV[4] or ""
local prefix = string.format("%05d", #key) .. key
local until_us, limit = tonumber(ARGV[2]), tonumber(ARGV[5])
local before = string.match(ARGV[3] or "", "^%d+$")
if key == "" or #key > 99999 or not until_us or until_us ~= until_us or until_us < 0
    or until_us == math.huge or not before or #before > 16 or not limit or limit < 1
    or limit ~= math.floor(limit)
    or (after ~= "" and string.sub(after, 1, #prefix) ~= prefix) then
  return redis.error_reply("ERR redis_throttle: void_parked takes a throttle key, until (µs "
    .. ">= 0), a wall time (µs, an integer), an index entry of that key or \"\" and a limit "
    .. "(an integer >= 1), got " .. table.concat(ARGV, " "))
end
before = string.rep("0", 16 - #before) .. before

local now = server_now()
local entries = redis.call("ZRANGEBYLEX", KEYS[2], after ~= "" and "(" .. after or "[" .. prefix,
  "[" .. prefix .. string.format("%017.0f", now + until_us) .. "\255", "LIMIT", 0, limit)
local released = 0
for _, entry in ipairs(entries) do
  if string.sub(entry, #prefix + 18, #prefix + 33) < before then
    redis.call("ZREM", KEYS[2], entry)
    local due, id = string.sub(entry, #prefix + 1, #prefix + 17), string.sub(entry, #prefix + 34)
    for _, member in ipairs(redis.call("ZRANGEBYSCORE", KEYS[1], due, due)) do
      if string.sub(member, 1, 33) == "r" .. id then
        redis.call("ZREM", KEYS[1], member)
        redis.call("ZADD", KEYS[1], string.format("%.0f", tonumber(due) - until_us),
          "a" .. string.sub(member, 2))
        released = released + 1
      end
    end
  end
end
return {released, #entries == limit and entries[#entries] or ""}
