#!lua
-- The shebang (Redis 7) declares a script that may write: a read-only replica or a Redis out of
-- memory refuses every call up front, not only the calls that happen to write.
-- Token bucket for one domain, in its GCRA form: the whole state is one number, the domain's
-- "theoretical arrival time" (TAT), i.e. when the bucket would be full again.
--
-- KEYS[1]  the domain's bucket key
-- ARGV[1]  interval: microseconds it takes to refill one token (1e6 / rate per second), > 0
-- ARGV[2]  burst: bucket size in tokens, >= 1
-- ARGV[3]  cost: tokens this request takes, > 0 and <= burst
-- ARGV[4]  reserve (optional, default 0): microseconds; a request that could go within that time
--          reserves its tokens now for the moment they are there
-- ARGV[5]  busy_for (optional, default 0): microseconds; the bucket is not full before now plus
--          this, whatever it holds: the caller took tokens from its local fallback while Redis
--          was unavailable, and they count here too
-- KEYS[2]  (optional, with the adaptive rate) the domain's rate key (see slow_down.lua): while
--          it holds a rate below the configured one, tokens refill at that rate
--
-- Returns {status, retry_after_us, reset_after_us}, integers (cheaper for Redis to reply than
-- formatted floats; a microsecond is far below any rate's precision):
--   status          1: the request may go now (its tokens are taken);
--                   2: reserved, it must go in retry_after_us (its tokens are taken);
--                   0: refused, nothing is taken; it could go in retry_after_us;
--                   3: the domain is paused (set live), nothing is taken
--   retry_after_us  how long until the request may go (0 when it may go now)
--   reset_after_us  how long until the bucket is full again (the key's expiry); the caller
--                   derives the tokens left from it: burst - reset_after_us / interval

-- ARGV[index] (or default) as a number, else an error reply naming the argument: finite, and
-- above minimum (or equal to it when inclusive).
local function number_arg(index, name, minimum, inclusive, default)
  local value = ARGV[index] or default
  local number = tonumber(value)
  if number == nil or number ~= number or number == math.huge or number < minimum
      or (number == minimum and not inclusive) then
    error(redis.error_reply(string.format(
      "ERR redis_throttle: %s must be a finite number %s %g, got %s",
      name, inclusive and ">=" or ">", minimum, tostring(value))))
  end
  return number
end

-- One test of every argument on the way of every call (a function call per argument cost 6%
-- more Redis CPU per call); number_arg names the bad one. Comparisons with NaN are false.
local huge = math.huge
local interval, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local reserve, busy_for = tonumber(ARGV[4] or "0"), tonumber(ARGV[5] or "0")
if not (interval and burst and cost and reserve and busy_for
    and interval > 0 and interval < huge and burst >= 1 and burst < huge
    and cost > 0 and cost < huge and reserve >= 0 and reserve < huge
    and busy_for >= 0 and busy_for < huge) then
  number_arg(1, "interval", 0, false)
  number_arg(2, "burst", 1, true)
  number_arg(3, "cost", 0, false)
  number_arg(4, "reserve", 0, true, "0")
  number_arg(5, "busy_for", 0, true, "0")
end
if cost > burst then
  -- Such a request could never go: refuse it instead of making it wait forever.
  return redis.error_reply("ERR redis_throttle: cost " .. ARGV[3] .. " exceeds burst " .. ARGV[2])
end

-- Server time, so that workers on machines with skewed clocks agree. Counted in microseconds
-- from 2024-01-01 to keep the numbers small enough for sub-microsecond precision in doubles.
local time = redis.call("TIME")
local now = (tonumber(time[1]) - 1704067200) * 1000000 + tonumber(time[2])

-- The state is an integer (microseconds), which Redis keeps inside the key's value object, with
-- no string to allocate: as little memory per domain as any key with an expiry can take
-- (bench/scale.py). Rounded up, to the polite side. A limit set live (lua/set_limit.lua)
-- follows it in the same value, "<tat> <rate|-> <burst|-> <paused 0|1>", so that reading it
-- costs no call, and it overrides ARGV's ("-": ARGV's).
local state = redis.call("GET", KEYS[1])
local tat = tonumber(state)
local live = ""
if state and not tat then
  local rate, live_burst, paused
  tat, live, rate, live_burst, paused = string.match(state, "^(%d+)( (%S+) (%S+) ([01]))$")
  if paused == "1" then
    return {3, 0, 0}
  end
  tat, live = tonumber(tat), live or ""
  if tonumber(rate) then
    interval = 1000000 / tonumber(rate)
  end
  if tonumber(live_burst) then
    burst = tonumber(live_burst)
    cost = math.min(cost, burst)
  end
end

if KEYS[2] then
  local rate, since, slope = string.match(redis.call("GET", KEYS[2]) or "", "^(%S+) (%S+) (%S+)")
  if rate then
    local lowered = tonumber(rate) + tonumber(slope) * math.max(0, now - tonumber(since))
    interval = math.max(interval, 1000000 / lowered)
  end
end

if tat == nil or tat < now + busy_for then
  tat = now + busy_for
end

local new_tat = math.ceil(tat + cost * interval)
-- From the unrounded time, to the nearest µs: with an interval that is no whole number of µs,
-- rounding up made the first request of a full bucket wait 1 µs instead of going.
local wait = math.max(0, math.floor(tat + (cost - burst) * interval - now + 0.5))
if wait > reserve then
  return {0, wait, math.ceil(tat - now)}
end

local reset_after = new_tat - now
if live == "" then
  -- The key lives exactly as long as the bucket is not full: idle domains vanish.
  redis.call("SET", KEYS[1], string.format("%d", new_tat), "PX", math.ceil(reset_after / 1000))
else
  redis.call("SET", KEYS[1], string.format("%d", new_tat) .. live)  -- lives as long as its limit
end
return {wait > 0 and 2 or 1, wait, reset_after}
