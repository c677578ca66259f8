-- What every script shares: scripts.py puts it in each one after its first line (the shebang,
-- which Redis wants first), itself after what Python owns (redis_schema.py, rates.py):
--   EPOCH              seconds: the scripts' clock counts from it (2024-01-01)
--   MAX_LIMITS         the most limits of a domain a call takes (of those set live, the first
--                      so many are read)
--   MAX_SLIDING_COUNT  the largest count of a sliding window (its log holds a member per
--                      request of the window)
--   MAX_SCOPES         the most scopes a request is under (scopes.py): its domain's and others

-- The longest interval (µs per token) and period, about 3 years: past what rates.py takes (at
-- most 1/365d), and every moment stays an exact integer of a double.
local MAX_INTERVAL = 1e14
-- What a call reads from Redis is bounded too: a value longer than this (the bucket's with a
-- live limit, a fixed window's state) is not one the scripts wrote, and is taken as absent
-- (Lua's patterns take time quadratic in the length of some garbage)...
local MAX_VALUE_BYTES = 4096
-- ...and so is a moment further ahead than this (µs, ~31 years: past any pause, and exact in a
-- double), whose wait would overflow the reply's integers.
local MAX_AHEAD = 1e15

-- Redis's time, so that workers on machines with skewed clocks agree, in µs since EPOCH: small
-- enough for sub-µs precision in doubles.
local function server_now()
  local time = redis.call("TIME")
  return (tonumber(time[1]) - EPOCH) * 1000000 + tonumber(time[2])
end

-- A number read from Redis, or nil: garbage (no number, not finite, or not below most) counts
-- as none, never as an error reply (which the workers would take for a failing Redis).
local function number_read(value, most)
  local number = tonumber(value)
  if number and number > -math.huge and number < most then
    return number
  end
end

-- A moment read from Redis (µs), or nil: garbage, or further ahead of now than MAX_AHEAD.
local function time_read(value, now)
  return number_read(value, now + MAX_AHEAD)
end

-- A domain's bucket (see token_bucket.lua): "<tat>", or with a limit set live "<tat> <rate|->
-- <burst|-> <paused 0|1>[ <more limits>]". Returns its time (a moment, or nil: none or
-- garbage), the live part as written (" <rate> ...", "" when none) and its fields, as strings
-- for the caller to check (nil when none). Garbage is no live limit: the workers' own applies.
-- Separators required: optional ones let Lua try every split of a long token (400 bytes took
-- 27 s). *tolerant*: a key of another type is none.
local function bucket_read(key, now, tolerant)
  local state
  if tolerant then
    -- Another scope's bucket (see token_bucket.lua), which many domains share: a key of another
    -- type there (written by hand) is garbage too, not an error for every request through it.
    state = redis.pcall("GET", key)
    if type(state) ~= "string" then
      state = ""
    end
  else
    state = redis.call("GET", key) or ""
  end
  if #state > MAX_VALUE_BYTES then
    return nil, ""
  end
  local tat = string.match(state, "^(%d+)$")
  if tat then
    return time_read(tat, now), ""
  end
  local live, rate, burst, paused, limits
  tat, live, rate, burst, paused, limits =
    string.match(state, "^(%d+)( (%S+) (%S+) ([01]) ?(%S*))$")
  return time_read(tat, now), live or "", rate, burst, paused, limits
end

-- A domain's void key (see voided.lua), "<voided_at> <voided_until>": the two moments, or nils.
local function voiding_read(key, now)
  local voided_at, voided_until =
    string.match(redis.call("GET", key) or "", "^(%d+) (%d+)$")
  return time_read(voided_at, now), time_read(voided_until, now)
end
