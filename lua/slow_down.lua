#!lua
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- The site struggles (it answered 429/503, or a request timed out): lower the domain's rate
-- for the whole fleet, multiplicatively. It climbs back linearly while no failure comes (the
-- additive increase), up to the configured rate; token_bucket.lua refills at it meanwhile.
-- A failure of a request sent before the last decrease says nothing about the lowered rate
-- and is ignored: the requests in flight when a site fails lower the rate once, not each.
-- The moments reserved before a decrease were chosen at the old rate: the bucket forgets
-- them, and the decrease is published like a pause (see penalty.lua) that lasts until the last
-- of them, so that the requests holding them ask again, for moments at the new rate.
--
-- KEYS[1]  the domain's bucket key
-- KEYS[2]  the domain's rate key: "<rate> <since> <slope> <lowered_at>": the rate (requests
--          per second) at `since`, from when it climbs by `slope` requests per second per µs;
--          times in µs like the bucket's (see token_bucket.lua). It expires once the rate is
--          back at the configured one.
-- KEYS[3]  the domain's void key (see voided.lua): what a worker that missed the message reads
-- ARGV[1]  the configured rate, requests per second, > 0
-- ARGV[2]  the floor, requests per second, > 0 (the configured rate when that is lower)
-- ARGV[3]  decrease: the factor the rate is multiplied by, > 0 and < 1
-- ARGV[4]  recovery: µs the rate takes to climb from the floor to the configured rate, > 0
-- ARGV[5]  age: µs since the failed request was sent, >= 0
-- ARGV[6]  hold: µs before the rate starts climbing (the pause that came with a 429), >= 0
-- ARGV[7]  burst of the domain's limit, >= 1
-- ARGV[8]  the channel to publish on
-- ARGV[9]  the domain's name in the message: "v<µs until the last moment reserved> <now µs>
--          <name>" (as set_limit.lua's: a voiding, not a pause)
--
-- Returns {lowered, rate, back_in_us, void_us, now_us}: lowered is 1 when this call lowered the
-- rate (0: the request was sent before the last decrease, or the configured rate is the floor);
-- rate (a string, in requests per second) is the rate now; when lowered, back_in_us is how
-- long until the rate is back at the configured one without another failure, and void_us how
-- long the moments reserved before now_us (when it ran) were to last (both 0 when not
-- lowered).

local numbers = {}
for index = 1, 7 do
  local number = tonumber(ARGV[index])
  if number == nil or number ~= number or math.abs(number) == math.huge then
    numbers = nil
    break
  end
  numbers[index] = number
end
local rate, floor, decrease, recovery, age, hold, burst = unpack(numbers or {})
if not (numbers and rate > 0 and floor > 0 and decrease > 0 and decrease < 1 and recovery > 0
    and age >= 0 and hold >= 0 and burst >= 1) then
  return redis.error_reply("ERR redis_throttle: slow_down takes finite numbers rate > 0, "
    .. "floor > 0, 0 < decrease < 1, recovery > 0, age >= 0, hold >= 0, burst >= 1; got "
    .. table.concat(ARGV, " ", 1, math.min(#ARGV, 7)))
end
local now = server_now()

-- A limit set live follows the bucket's time in its value (see token_bucket.lua): its rate, if
-- it sets one, is the configured rate here; the value is kept.
local tat, live, live_rate = bucket_read(KEYS[1], now)
live_rate = number_read(live_rate, math.huge)
if live_rate and live_rate > 0 then
  rate = live_rate
end
floor = math.min(floor, rate)
if floor == rate then
  return {0, string.format("%.17g", rate), 0, 0, now}
end

local current = rate
local was, since, slope, lowered_at = string.match(
  redis.call("GET", KEYS[2]) or "", "^(%S+) (%S+) (%S+) (%S+)$")
was, since, slope = number_read(was, math.huge), time_read(since, now),
  number_read(slope, math.huge)
lowered_at = time_read(lowered_at, now)
if was and since and slope and lowered_at then
  current = math.min(rate, was + slope * math.max(0, now - since))
  if now - age < lowered_at then
    return {0, string.format("%.17g", current), 0, 0, now}
  end
end

slope = (rate - floor) / recovery
local lowered = math.max(floor, current * decrease)
hold = math.ceil(hold)
-- The key lives until the rate is back at the configured one: then it says nothing.
local lifetime = math.ceil(hold + (rate - lowered) / slope)
redis.call("SET", KEYS[2], string.format("%.17g %d %.17g %d", lowered, now + hold, slope, now),
  "PX", math.max(1, math.ceil(lifetime / 1000)))

-- The bucket starts again after the hold, at the new rate and without a burst (as after a
-- pause); a bucket that is full by then expires at once.
local void = math.max(0, math.ceil((tat or now) - now))
tat = math.ceil(now + hold + (burst - 1) * 1000000 / lowered)
redis.call("SET", KEYS[1], string.format("%d", tat) .. live,
  unpack(live == "" and {"PX", math.max(1, math.ceil((tat - now) / 1000))} or {}))
if void > 0 then
  -- Kept for the workers that were not subscribed when it was published (see voided.lua).
  local _, voided_until = string.match(redis.call("GET", KEYS[3]) or "", "^(%d+) (%d+)$")
  voided_until = math.max(now + void, time_read(voided_until, now) or 0)
  redis.call("SET", KEYS[3], string.format("%d %d", now, voided_until),
    "PX", math.ceil((voided_until - now) / 1000))
  redis.call("PUBLISH", ARGV[8], string.format("v%d %d", void, now) .. " " .. ARGV[9])
end
return {1, string.format("%.17g", lowered), lifetime, void, now}
