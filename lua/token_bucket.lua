#!lua
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
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
--          (from not_before, when that is later than now) reserves its tokens now for the moment
--          they are there. Below 0: nothing is taken, the reply only tells when (a peek)
-- ARGV[5]  busy_until (optional, default 0: none): µs since the epoch by Redis's clock; the
--          bucket is not full before it, whatever it holds: when the caller sees the bucket full
--          again (the tokens it took from its local fallback while Redis was unavailable, and
--          the moments Redis gave out, which it may have lost since). A moment, not a duration:
--          a call that reaches Redis late does not push the bucket later
-- ARGV[6]  not_before (optional, default 0): µs since the epoch by Redis's clock; the request's
--          moment is not before it (the moment its other scopes' buckets gave it, on other nodes
--          of a Redis Cluster: see across_nodes.py)
-- ARGV[7]  alone (optional, default "0"): "1" when KEYS[1] is another scope's bucket, asked on its
--          own (on a Redis Cluster: across_nodes.py): it is read as KEYS[5..] are in one call (a
--          key of another type is none, and replaced; a live limit's more limits do not count)
-- ARGV[8..] (optional) more limits of the domain (at most MAX_LIMITS), checked with the bucket
--          in this call, three arguments each: the algorithm ("t" token bucket, "f" fixed window,
--          "s" sliding window), its count (the bucket's burst, or the requests per window, an
--          integer, at most MAX_SLIDING_COUNT for a sliding window) and its period in
--          microseconds (per token, or the window)
-- KEYS[2]  (optional, with the adaptive rate or more limits) the domain's rate key (see
--          slow_down.lua): while it holds a rate below the configured one, tokens refill at it
-- KEYS[3]  (with more limits) the domain's quota hash: per limit, a bucket's time or a fixed
--          window's "<window> <count>"
-- KEYS[4]  (with more limits) the domain's log: a sorted set of the moments requests went, for
--          the sliding windows
-- KEYS[5..] (optional, after all four keys above) the buckets of the request's other scopes (at
--          most MAX_SCOPES - 1; see scopes.py): each must allow the request too. ARGV ends with
--          three arguments for each, in order: its interval, its burst (a limit set live in its
--          bucket overrides them, and one paused live pauses the request) and its busy_until
--
-- With more limits or other scopes, a request goes (or reserves its moment) only when every limit
-- and every bucket allows it, nothing is taken from any of them when one refuses, and the wait
-- is the longest (or longer: until a fixed window with room for it).
--
-- Returns {status, retry_after_us, reset_after_us, now_us[, remaining][, step][, live]},
-- integers (cheaper for Redis to reply than formatted floats; a microsecond is far below any
-- rate's precision) but live:
--   status          1: the request may go now (its tokens are taken);
--                   2: reserved, it must go in retry_after_us (its tokens are taken);
--                   0: refused, nothing is taken; it could go in retry_after_us;
--                   3: the domain (or another scope's bucket) is paused (set live), nothing is
--                      taken;
--                   4: the domain has more limits set live: call again with KEYS[2..4]
--                   8 more (8, 9, 10) for 0, 1 and 2: as those, and the domain's limit set live
--                      has a field that is no limit, which was ignored
--   retry_after_us  how long until the request may go (0 when it may go now)
--   reset_after_us  how long until the domain's bucket is full again (its key's expiry); the caller
--                   derives the tokens left from it: burst - reset_after_us / interval
--   now_us          when the script decided, by Redis's clock (µs since 2024-01-01): the
--                   caller counts the times above from then, not from when it read the reply
--                   (which may be late), so that its request goes at the moment Redis gave it
--   remaining       with more limits: the requests they allow after this one, now (0 when it
--                   must wait)
--   step            with status 2: µs the reservation added to the bucket's time, for
--                   unreserve.lua (with reset_after: the bucket's time after it)
--   live            unless alone is "1": the domain's limit set live, a string (see reply below)

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

-- Bounds on the work of a call (rates.py and set_limit.lua refuse more), with the prelude's
-- MAX_LIMITS and MAX_SLIDING_COUNT (a request adds one member to the log per unit of its cost,
-- at most the count): how many fixed windows after the current one hold reservations: a request
-- due later reserves nothing (it asks again), so a window's state holds at most
-- MAX_WINDOWS_AHEAD + 1.
local MAX_WINDOWS_AHEAD = 64
-- Members of the log added by one ZADD (Lua's stack holds a few thousand arguments).
local ZADD_BATCH = 1000

-- Whether algorithm, count and period (numbers, or nil) make a limit: a whole count (a request
-- costs whole tokens of it: 1.5 refused a cost of 2 the workers' limits allowed), and a window's
-- period whole too (window n starts at n x period exactly).
local function limit_ok(algorithm, count, period)
  return (algorithm == "t" or algorithm == "f" or algorithm == "s") and count ~= nil
    and period ~= nil and count >= 1 and count < math.huge and period > 0
    and period <= MAX_INTERVAL
    and count == math.floor(count) and (algorithm == "t" or period == math.floor(period))
    and (algorithm ~= "s" or count <= MAX_SLIDING_COUNT)
end

-- A bucket's limit set live (the fields bucket_read returns) over the workers' interval, burst and
-- cost. Read from Redis, checked as the arguments are: a field that is no limit (garbage, written
-- by hand) is ignored and the workers' own applies, never an error every request would get.
-- Returns the interval, burst and cost that apply, whether the live rate stands (its more
-- limits with it), and whether every field set ("-": none) was a limit.
local function live_limit(interval, burst, cost, rate, live_burst)
  local live_rate, live_count = tonumber(rate), tonumber(live_burst)
  local rate_stands = live_rate and live_rate > 0 and 1000000 / live_rate > 0
    and 1000000 / live_rate <= MAX_INTERVAL
  if rate_stands then
    interval = 1000000 / live_rate
  end
  local burst_stands = live_count and live_count >= 1 and live_count < math.huge
    and live_count == math.floor(live_count)
  if burst_stands then
    burst = live_count
    cost = math.min(cost, burst)
  end
  return interval, burst, cost, rate_stands,
    (rate == "-" or rate_stands) and (live_burst == "-" or burst_stands)
end

-- A bucket's new time (µs, a whole number), written: it lives exactly as long as the bucket is
-- not full (idle domains vanish), or with a limit set live (its *live* part) as long as that.
local function bucket_write(key, new_tat, now, live)
  if live == "" then
    redis.call("SET", key, string.format("%d", new_tat), "PX", math.ceil((new_tat - now) / 1000))
  else
    redis.call("SET", key, string.format("%d", new_tat) .. live)
  end
end

-- One test of every argument on the way of every call (a function call per argument cost 6%
-- more Redis CPU per call); number_arg names the bad one. Comparisons with NaN are false.
local huge = math.huge
local interval, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local reserve, busy_until = tonumber(ARGV[4] or "0"), tonumber(ARGV[5] or "0")
local not_before, alone = tonumber(ARGV[6] or "0"), ARGV[7] or "0"
if not (interval and burst and cost and reserve and busy_until and not_before
    and interval > 0 and interval <= MAX_INTERVAL and burst >= 1 and burst < huge
    and cost > 0 and cost < huge and reserve > -huge and reserve < huge
    and busy_until >= 0 and busy_until < huge and not_before >= 0 and not_before < huge) then
  number_arg(1, "interval", 0, false)
  number_arg(2, "burst", 1, true)
  number_arg(3, "cost", 0, false)
  number_arg(4, "reserve", -huge, false, "0")
  number_arg(5, "busy_until", 0, true, "0")
  number_arg(6, "not_before", 0, true, "0")
  return redis.error_reply("ERR redis_throttle: interval must be at most 1e14, got " .. ARGV[1])
end
if cost > burst then
  -- Such a request could never go: refuse it instead of making it wait forever.
  return redis.error_reply("ERR redis_throttle: cost " .. ARGV[3] .. " exceeds burst " .. ARGV[2])
end

-- Server time, so that workers on machines with skewed clocks agree. Counted in microseconds
-- from 2024-01-01 to keep the numbers small enough for sub-microsecond precision in doubles.
local now = server_now()
if not_before >= now + MAX_AHEAD then
  return redis.error_reply("ERR redis_throttle: not_before must be before now + 1e15, got "
    .. ARGV[6])
end
if busy_until >= now + MAX_AHEAD then
  return redis.error_reply("ERR redis_throttle: busy_until must be before now + 1e15, got "
    .. ARGV[5])
end

-- The state is an integer (microseconds), which Redis keeps inside the key's value object, with
-- no string to allocate: as little memory per domain as any key with an expiry can take
-- (bench/scale.py). Rounded up, to the polite side. A limit set live (lua/set_limit.lua)
-- follows it in the same value, "<tat> <rate|-> <burst|-> <paused 0|1>[ <more limits>]", so
-- that reading it costs no call, and it overrides ARGV's ("-": ARGV's). A rate set live comes
-- with the domain's more limits ("t5/2e5,s10/2e6": algorithm, count/period), maybe none.
if alone ~= "0" and alone ~= "1" then
  return redis.error_reply("ERR redis_throttle: alone must be 0 or 1, got " .. alone)
end
local tat, live, rate, live_burst, paused, live_limits = bucket_read(KEYS[1], now, alone == "1")
-- A reply, with the domain's limit set live last ("<rate|-> <burst|-> <paused 0|1>[ <more
-- limits>]" as set_limit.lua returns it, "" for none) when KEYS[1] is the domain's own bucket:
-- the caller learns in the same call when a change or a pause reaches it.
local function reply(values)
  if alone == "0" then
    values[#values + 1] = string.sub(live, 2)
  end
  return values
end
if paused == "1" then
  return reply({3, 0, 0, now})
end
-- 8 when the domain's limit set live has a field that is no limit (added to the status).
local invalid = 0
if live ~= "" then
  local rate_stands, valid
  interval, burst, cost, rate_stands, valid = live_limit(interval, burst, cost, rate, live_burst)
  if not valid and alone == "0" then
    invalid = 8
  end
  if not rate_stands or alone == "1" then
    live_limits = nil
  end
end

-- The other scopes' buckets (KEYS[5..]), with their limits at the end of ARGV.
local others = math.max(0, #KEYS - 4)
if others > MAX_SCOPES - 1 then
  return redis.error_reply("ERR redis_throttle: at most " .. MAX_SCOPES - 1 .. " other scopes, got "
    .. others)
end
local more_end = #ARGV - 3 * others  -- the more limits' last argument
if others > 0 and (more_end < 7 or (more_end - 7) % 3 ~= 0) then
  return redis.error_reply("ERR redis_throttle: " .. others .. " other scopes take 7 arguments, "
    .. "3 per more limit and 3 per other scope, got " .. #ARGV)
end

-- The more limits (nil: none): those set live with the rate, else ARGV's.
local limits
if live_limits and live_limits ~= "" then
  limits = {}
  -- Anchored at each item (gmatch's search from every position took time quadratic in the
  -- length of garbage): the first item that is none ends the list.
  local position = 1
  while #limits < MAX_LIMITS do
    local _, last, algorithm, count, period =
      string.find(live_limits, "^(%a)([^/,]+)/([^,]+),?", position)
    if not last then
      break
    end
    position = last + 1
    if limit_ok(algorithm, tonumber(count), tonumber(period)) then  -- else ignored, as above
      limits[#limits + 1] = {algorithm, count, period}
      -- As with a live burst: a request the workers' own limits let cost more goes at this cost.
      cost = math.min(cost, tonumber(count))
    else
      invalid = 8
    end
  end
  if position <= #live_limits then
    invalid = 8  -- what follows the last limit read is none, or one too many
  end
  if #limits == 0 then
    limits = nil
  end
elseif not live_limits and more_end >= 8 then
  if more_end > 7 + 3 * MAX_LIMITS then
    return redis.error_reply("ERR redis_throttle: at most " .. MAX_LIMITS .. " more limits, got "
      .. (more_end - 7) / 3)
  end
  limits = {}
  for index = 8, more_end, 3 do
    limits[#limits + 1] = {ARGV[index], ARGV[index + 1], ARGV[index + 2]}
  end
end
if limits and not KEYS[4] then
  return reply({4, 0, 0, now})
end

if KEYS[2] then
  local adaptive = redis.call("GET", KEYS[2]) or ""
  if #adaptive > MAX_VALUE_BYTES then
    adaptive = ""
  end
  local rate, since, slope = string.match(adaptive, "^(%S+) (%S+) (%S+)")
  rate, since, slope = tonumber(rate), tonumber(since), tonumber(slope)
  if rate and since and slope then
    local lowered = rate + slope * math.max(0, now - since)
    -- A lowered rate that is none (garbage in the key) is ignored, as a live field.
    if lowered > 0 and 1000000 / lowered <= MAX_INTERVAL then
      interval = math.max(interval, 1000000 / lowered)
    end
  end
end

-- Not before now (a key outlives its time by up to a millisecond: PX), nor before busy_until.
tat = math.max(tat or now, now, busy_until)

-- From the unrounded time, to the nearest µs: with an interval that is no whole number of µs,
-- rounding up made the first request of a full bucket wait 1 µs instead of going.
local wait = math.max(0, math.floor(tat + (cost - burst) * interval - now + 0.5))
-- Not before not_before, whole µs (as every wait), from which reserve counts.
local after = math.max(0, math.ceil(not_before - now))
wait = math.max(wait, after)

-- Each other scope's bucket: the request's moment is the latest of those they allow it too.
local other_buckets = {}
for n = 1, others do
  local index = more_end + 3 * n - 2
  local other_interval, other_burst, other_busy_until =
    tonumber(ARGV[index]), tonumber(ARGV[index + 1]), tonumber(ARGV[index + 2])
  if not (other_interval and other_burst and other_busy_until and other_interval > 0
      and other_interval <= MAX_INTERVAL and other_burst >= 1 and other_burst < huge
      and other_busy_until >= 0 and other_busy_until < now + MAX_AHEAD) then
    return redis.error_reply(string.format("ERR redis_throttle: scope %d's interval, burst and "
      .. "busy_until must be numbers > 0 (at most 1e14), >= 1 (finite) and >= 0 (before now + "
      .. "1e15), got %s %s %s",
      n + 1, tostring(ARGV[index]), tostring(ARGV[index + 1]), tostring(ARGV[index + 2])))
  end
  local other_cost = math.min(tonumber(ARGV[3]), other_burst)
  if tonumber(ARGV[3]) > other_burst then
    return redis.error_reply("ERR redis_throttle: cost " .. ARGV[3] .. " exceeds scope " .. n + 1
      .. "'s burst " .. ARGV[index + 1])
  end
  local other_tat, other_live, other_rate, other_live_burst, other_paused =
    bucket_read(KEYS[4 + n], now, true)
  if other_paused == "1" then
    return reply({3, 0, 0, now})
  end
  if other_live ~= "" then
    other_interval, other_burst, other_cost =
      live_limit(other_interval, other_burst, other_cost, other_rate, other_live_burst)
  end
  other_tat = math.max(other_tat or now, now, other_busy_until)
  other_buckets[n] = {tat = other_tat, interval = other_interval, burst = other_burst,
    cost = other_cost, live = other_live}
  wait = math.max(wait,
    math.floor(other_tat + (other_cost - other_burst) * other_interval - now + 0.5))
end

-- The more limits: the request's moment is the latest of the moments each one allows it,
-- moved to the start of a fixed window with room where it must.
local quotas, longest_window, counted
if limits then
  quotas, longest_window = {}, 0
  counted = math.ceil(cost)  -- a window counts whole requests
  local moment = now + wait
  for index, limit in ipairs(limits) do
    local algorithm, count, period = limit[1], tonumber(limit[2]), tonumber(limit[3])
    if not limit_ok(algorithm, count, period) then
      return redis.error_reply("ERR redis_throttle: limit " .. index .. " must be t, f or s, a "
        .. "whole count >= 1 (at most 10000 for s) and a period > 0, at most 1e14 (whole for "
        .. "windows), got "
        .. table.concat({tostring(limit[1]), tostring(limit[2]), tostring(limit[3])}, " "))
    end
    if counted > count then
      return redis.error_reply("ERR redis_throttle: cost " .. ARGV[3] .. " exceeds limit "
        .. index .. "'s count " .. limit[2])
    end
    local quota = {algorithm = algorithm, count = count, period = period,
      field = algorithm .. limit[2] .. "/" .. limit[3]}
    if algorithm == "t" then
      -- busy_until is the domain's own bucket's: a quota's tokens were not taken meanwhile.
      local quota_tat = tonumber(redis.call("HGET", KEYS[3], quota.field))
      if not (quota_tat and quota_tat < now + MAX_AHEAD) then  -- (NaN fails too)
        quota_tat = now
      end
      quota.tat = math.max(quota_tat, now)
      moment = math.max(moment, quota.tat + (cost - count) * period)
    elseif algorithm == "f" then
      -- "<window> <count> ...": the requests of each window from now on (some reserved ahead).
      -- Windows follow one another from the epoch: every worker agrees on them.
      quota.windows = {}
      local state = redis.call("HGET", KEYS[3], quota.field) or ""
      if #state > MAX_VALUE_BYTES then
        state = ""
      end
      local current, position = math.floor(now / period), 1
      -- Written in order, at most MAX_WINDOWS_AHEAD + 1 windows; a window further ahead is
      -- garbage. Anchored at each pair, as the live limits above.
      for _ = 0, MAX_WINDOWS_AHEAD do
        local _, last, window, used = string.find(state, "^(%d+) (%d+) ?", position)
        if not last then
          break
        end
        position = last + 1
        window = tonumber(window)
        if window >= current and window <= current + MAX_WINDOWS_AHEAD then
          quota.windows[window] = tonumber(used)
        end
      end
    else
      -- Exact: no window of `period` µs (a moment exactly one period before is out of it) holds
      -- more than `count`. The log holds the moments of the requests, reserved ones too: once the
      -- oldest that are too many are out of its window, any later moment keeps every window right.
      local since = "(" .. string.format("%.17g", now - period)
      quota.used = redis.call("ZCOUNT", KEYS[4], since, "+inf") + counted
      if quota.used > count then
        local oldest = redis.call("ZRANGEBYSCORE", KEYS[4], since, "+inf", "WITHSCORES", "LIMIT",
          quota.used - count - 1, 1)
        local oldest_moment = tonumber(oldest[2])
        if oldest_moment < now + MAX_AHEAD then  -- else a member no script wrote
          moment = math.max(moment, oldest_moment + period)
        end
      end
      longest_window = math.max(longest_window, period)
    end
    quotas[index] = quota
  end
  local too_far = false
  repeat
    local moved = false
    for _, quota in ipairs(quotas) do
      local window = math.floor(moment / quota.period)
      if quota.windows and (quota.windows[window] or 0) + counted > quota.count then
        moment, moved = (window + 1) * quota.period, true
      end
      too_far = too_far or (quota.windows
        and math.floor(moment / quota.period) > math.floor(now / quota.period) + MAX_WINDOWS_AHEAD)
    end
  -- Each move passes a window with reservations: a bounded number of turns.
  until not moved or too_far
  wait = math.max(wait, math.ceil(moment - now))
  if too_far then
    reserve = -1  -- reserve nothing: the request asks again when it is due
  end
end

if wait > after + reserve then
  if limits then
    return reply({invalid, wait, math.ceil(tat - now), now, 0})
  end
  return reply({invalid, wait, math.ceil(tat - now), now})
end

local moment = now + wait
-- A moment the quotas, another scope or not_before put after the bucket's: the bucket counts
-- the request then (it stands idle until then: GCRA's one time keeps no tokens before it for
-- others). Whole µs, rounded up (the polite side): the time the request adds to, and the step
-- it adds, which unreserve.lua takes back out when a reserved request does not go (the other
-- scopes' buckets keep it: they are not given back). Every bucket counts it at the same moment,
-- the latest.
local base = math.ceil((limits or others > 0 or after > 0) and math.max(tat, moment) or tat)
local new_tat = math.ceil(base + cost * interval)
local step = new_tat - base
local reset_after = new_tat - now
bucket_write(KEYS[1], new_tat, now, live)
for n, other in ipairs(other_buckets) do
  bucket_write(KEYS[4 + n], math.ceil(math.max(other.tat, moment) + other.cost * other.interval),
    now, other.live)
end
if not limits then
  if wait > 0 then
    return reply({invalid + 2, wait, reset_after, now, step})
  end
  return reply({invalid + 1, wait, reset_after, now})
end

-- The requests each quota allows after this one, now (none when it must wait).
local remaining, quota_expiry = wait > 0 and 0 or huge, 0
for _, quota in ipairs(quotas) do
  local left, value, expiry
  if quota.tat then
    value = math.ceil(math.max(quota.tat, moment) + cost * quota.period)
    expiry, left = value - now, quota.count - (value - now) / quota.period
    value = string.format("%d", value)
  elseif quota.windows then
    local window = math.floor(moment / quota.period)
    quota.windows[window] = (quota.windows[window] or 0) + counted
    local windows = {}
    for start in pairs(quota.windows) do
      windows[#windows + 1] = start
    end
    table.sort(windows)
    expiry = math.ceil((windows[#windows] + 1) * quota.period - now)
    for n, start in ipairs(windows) do
      windows[n] = string.format("%d %d", start, quota.windows[start])
    end
    value = table.concat(windows, " ")
    left = quota.count - (quota.windows[math.floor(now / quota.period)] or 0)
  else
    left = quota.count - quota.used
  end
  if value then
    redis.call("HSET", KEYS[3], quota.field, value)
    quota_expiry = math.max(quota_expiry, expiry)
  end
  remaining = math.min(remaining, left)
end
if quota_expiry > 0 then
  redis.call("PEXPIRE", KEYS[3], math.ceil(quota_expiry / 1000))
end
if longest_window > 0 then
  -- Members are unique: those of one microsecond are numbered.
  local first = redis.call("ZCOUNT", KEYS[4], moment, moment)
  for batch = first, first + counted - 1, ZADD_BATCH do
    local members = {}
    for number = batch + 1, math.min(batch + ZADD_BATCH, first + counted) do
      members[#members + 1] = moment
      members[#members + 1] = string.format("%d:%d", moment, number)
    end
    redis.call("ZADD", KEYS[4], unpack(members))
  end
  redis.call("ZREMRANGEBYSCORE", KEYS[4], "-inf", string.format("%.17g", now - longest_window))
  local last = tonumber(redis.call("ZRANGE", KEYS[4], -1, -1, "WITHSCORES")[2])
  if not (last < now + MAX_AHEAD) then  -- a member no script wrote: it goes with the key
    last = moment
  end
  redis.call("PEXPIRE", KEYS[4], math.ceil((last + longest_window - now) / 1000))
end
if wait > 0 then
  return reply({invalid + 2, wait, reset_after, now, 0, step})
end
return reply({invalid + 1, wait, reset_after, now, math.floor(math.max(0, remaining))})
