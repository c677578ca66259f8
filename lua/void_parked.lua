#!lua flags=allow-oom
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- The shebang (Redis 7) declares a script that may write. It adds no memory (each member it
-- takes out of the index comes back as one of the same size), so a Redis out of memory lets it
-- run, as it lets unpark.lua.
-- A voiding (a pause, a decrease of the adaptive rate, a limit changed live: see
-- scrapy_redis_throttle/penalties.py; or Redis lost the throttle's state, every key's) reaches
-- the requests parked with a moment it voids: they become due now and marked to ask Redis again
-- ("a"), instead of waiting for their old moments to learn it, in the order of their moments
-- (each scored as much earlier as until is ahead). Every worker that hears a voiding calls this;
-- the first does the work.
--
-- KEYS[1]  the spider's parking set (see park.lua)
-- KEYS[2]  its index of reserved moments (see park.lua)
-- ARGV[1]  the throttle key ("": every key's)
-- ARGV[2]  until: µs from now; the voided moments are those up to then...
-- ARGV[3]  ...reserved before this wall time (µs, an integer: it is compared with the parking
--          workers' reserved_at, so the caller allows for their clocks)
-- ARGV[4]  "", or the last index entry the previous call looked at: go on after it
-- ARGV[5]  limit: the most index entries to look at, an integer >= 1
--
-- Returns {released, last}: how many requests became due now, and the last index entry looked
-- at, for the next call ("" when there is nothing more to look at).

local key, after = ARGV[1] or "", ARGV[4] or ""
local prefix = key == "" and "" or string.format("%05d", #key) .. key
local until_us, limit = tonumber(ARGV[2]), tonumber(ARGV[5])
local before = string.match(ARGV[3] or "", "^%d+$")
if #key > 99999 or not until_us or until_us ~= until_us or until_us < 0
    or until_us == math.huge or not before or #before > 16 or not limit or limit < 1
    or limit ~= math.floor(limit)
    or (after ~= "" and string.sub(after, 1, #prefix) ~= prefix) then
  return redis.error_reply("ERR redis_throttle: void_parked takes a throttle key or \"\", until "
    .. "(µs >= 0), a wall time (µs, an integer), an index entry of that key or \"\" and a limit "
    .. "(an integer >= 1), got " .. table.concat(ARGV, " "))
end
before = string.rep("0", 16 - #before) .. before

local now = server_now()
local last_due = string.format("%017.0f", now + until_us)
local entries
if key == "" then
  entries = redis.call("ZRANGEBYLEX", KEYS[2], after ~= "" and "(" .. after or "-", "+", "LIMIT",
    0, limit)
else
  entries = redis.call("ZRANGEBYLEX", KEYS[2], after ~= "" and "(" .. after or "[" .. prefix,
    "[" .. prefix .. last_due .. "\255", "LIMIT", 0, limit)
end
local released = 0
for _, entry in ipairs(entries) do
  -- "<key's length, 5 digits><key><due, 17 digits><reserved at, 16 digits><id>" (park.lua)
  local length = tonumber(string.match(entry, "^%d%d%d%d%d"))
  local due = length and string.sub(entry, 6 + length, 22 + length)
  if due and string.match(due, "^%d+$") and #due == 17 and due <= last_due
      and string.sub(entry, 23 + length, 38 + length) < before then
    redis.call("ZREM", KEYS[2], entry)
    local id = string.sub(entry, 39 + length)
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
