#!lua
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- A site answered 429 or 503: pause its domain for the whole fleet. The bucket's "full again
-- at" time (see token_bucket.lua) is pushed past the pause, so that no acquire succeeds before
-- it ends; the pause is published, so that requests that reserved a moment within it ask again.
--
-- KEYS[1]  the domain's bucket key
-- KEYS[2]  the domain's penalty key: a hash {strikes, until}, until in µs like the bucket's time
-- KEYS[3]  the domain's void key (see voided.lua): what a worker that missed the message reads
-- ARGV[1]  interval: microseconds per token of the domain's limit, > 0
-- ARGV[2]  burst of the domain's limit, >= 1
-- ARGV[3]  retry_after: microseconds the site asked for (Retry-After), >= 0; -1: none given
-- ARGV[4]  backoff: the first pause without Retry-After, microseconds, > 0; it doubles with
--          each penalty that comes after the previous pause ended
-- ARGV[5]  max_pause: microseconds, > 0, the longest pause (Retry-After included)
-- ARGV[6]  decay: microseconds after a pause without a new penalty that undo one doubling, > 0
-- ARGV[7]  the channel to publish the pause on
-- ARGV[8]  the domain's name in the message: "<pause µs> <now µs> <name>" (now: the moments
--          reserved before it, by token_bucket.lua's clock, are the voided ones)
--
-- Returns {changed, pause_us, strikes, now_us}: changed is 1 when this call started or extended
-- the pause (0: a pause as long was already under way: a response to a request sent before it);
-- pause_us is the time left until the pause ends; strikes counts the penalties in a row; now_us
-- when it ran (no moment within the pause was reserved after it: the bucket is past it).

local limits = {{">", 0}, {">=", 1}, {">=", -1}, {">", 0}, {">", 0}, {">", 0}}
local numbers = {}
for index, limit in ipairs(limits) do
  local number = tonumber(ARGV[index])
  local ok = number ~= nil and number == number and math.abs(number) ~= math.huge
  if ok then
    ok = (limit[1] == ">" and number > limit[2]) or (limit[1] == ">=" and number >= limit[2])
  end
  if not ok then
    return redis.error_reply(string.format(
      "ERR redis_throttle: penalty argument %d must be a finite number %s %d, got %s",
      index, limit[1], limit[2], tostring(ARGV[index])))
  end
  numbers[index] = number
end
local interval, burst, retry_after, backoff, max_pause, decay = unpack(numbers)

-- More strikes than this no longer lengthen the pause (2^64 backoffs): bounded garbage too.
local MAX_STRIKES = 64

local now = server_now()

local state = redis.call("HMGET", KEYS[2], "strikes", "until")
local strikes = tonumber(state[1]) or 0
if not (strikes >= 0 and strikes <= MAX_STRIKES) then  -- (NaN fails too)
  strikes = strikes == strikes and strikes > 0 and MAX_STRIKES or 0
end
strikes = math.floor(strikes)
local paused_until = time_read(state[2], now) or 0
local pause
if now < paused_until then
  -- Already paused: only a longer Retry-After extends the pause; strikes stay.
  if retry_after < 0 then
    return {0, paused_until - now, strikes, now}
  end
  pause = retry_after
else
  -- One doubling undone per decay spent since the last pause ended.
  strikes = math.min(math.max(0, strikes - math.floor((now - paused_until) / decay)) + 1,
    MAX_STRIKES)
  pause = retry_after
  if pause < 0 then
    pause = backoff * 2 ^ (strikes - 1)
  end
end
pause = math.ceil(math.min(pause, max_pause))
-- A pause of 0 (Retry-After: 0, or a date already past) still counts, and is published: it
-- lasts no time, and every expiry below is at least 1 ms (Redis refuses PX 0).
local new_until = now + pause
if new_until <= paused_until then
  return {0, paused_until - now, strikes, now}
end

redis.call("HSET", KEYS[2], "strikes", strikes, "until", string.format("%d", new_until))
redis.call("PEXPIRE", KEYS[2], math.ceil((pause + decay * strikes) / 1000))
-- No token before the pause ends, and none to spare at its end: the domain starts again at
-- its rate, without a burst.
-- A limit set live follows the bucket's time in its value (see token_bucket.lua): kept.
local tat, live = bucket_read(KEYS[1], now)
tat = math.max(tat or 0, new_until + (burst - 1) * interval)
redis.call("SET", KEYS[1], string.format("%d", tat) .. live,
  unpack(live == "" and {"PX", math.max(1, math.ceil((tat - now) / 1000))} or {}))
-- Kept for the workers that were not subscribed when it was published (see voided.lua).
local _, voided_until = voiding_read(KEYS[3], now)
voided_until = math.max(new_until, voided_until or 0)
redis.call("SET", KEYS[3], string.format("%d %d", now, voided_until),
  "PX", math.max(1, math.ceil((voided_until - now) / 1000)))
redis.call("PUBLISH", ARGV[7], string.format("%d %d", pause, now) .. " " .. ARGV[8])
return {1, pause, strikes, now}
