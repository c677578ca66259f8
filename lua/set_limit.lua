#!lua
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- Change a domain's limit live, for every worker at its next request: the limit is kept after
-- the bucket's time in the bucket's own value (see token_bucket.lua), which then lives on until
-- the limit is deleted. The moments reserved before a change were chosen under the old limit:
-- the bucket forgets them, and the change is published like a pause lasting until the last of
-- them (see penalty.lua), so that the requests holding them ask again at once.
--
-- KEYS[1]  the domain's bucket key
-- KEYS[2]  the domain's penalty key (see penalty.lua): a pause under way goes on
-- KEYS[3]  the domain's void key (see voided.lua): what a worker that missed the message reads
-- ARGV[1]  action: "set" (ARGV[2] and ARGV[3] become the domain's rate and burst), "delete"
--          (back to the workers' own configuration), "pause" or "resume"
-- ARGV[2]  rate, requests per second (> 0), or "-": the workers' own
-- ARGV[3]  burst (an integer >= 1), or "-": the workers' own
-- ARGV[4]  the channel to publish on
-- ARGV[5]  the domain's name in the message: "v<µs until the last moment reserved> <now µs>
--          <name>" (the moments reserved before now, by token_bucket.lua's clock, are void; the
--          "v": a voiding, not a pause, after which requests may go at once)
-- ARGV[6]  (set, with a rate) the domain's more limits, "" for none: comma-separated
--          "<algorithm><count>/<period µs>", algorithm t, f or s (see token_bucket.lua)
--
-- Returns {live, void_us}: the domain's live limit now ("<rate|-> <burst|-> <paused 0|1>[ <more
-- limits>]", "" when none), and how long the moments reserved before were to last (0 when none
-- were voided).


local action, rate, burst, limits = ARGV[1], ARGV[2], ARGV[3], ARGV[6] or ""
local valid_rate = rate == "-" or (tonumber(rate) and 1000000 / tonumber(rate) > 0
  and 1000000 / tonumber(rate) <= MAX_INTERVAL)
local valid_burst = burst == "-" or (tonumber(burst) and tonumber(burst) >= 1
  and tonumber(burst) == math.floor(tonumber(burst)) and tonumber(burst) < math.huge)
-- Checked as token_bucket.lua checks them: a bad limit here would fail every acquire.
local valid_limits = limits == "" or rate ~= "-"
local limits_count = 0
for item in string.gmatch(limits ~= "" and limits .. "," or "", "([^,]*),") do
  local algorithm, count, period = string.match(item, "^([tfs])([%d.eE+-]+)/([%d.eE+-]+)$")
  count, period = tonumber(count), tonumber(period)
  limits_count = limits_count + 1
  valid_limits = valid_limits and count and period and count >= 1 and count < math.huge
    and period > 0 and period <= MAX_INTERVAL and limits_count <= MAX_LIMITS
    and count == math.floor(count) and (algorithm == "t" or period == math.floor(period))
    and (algorithm ~= "s" or count <= MAX_SLIDING_COUNT)
end
if not (action == "set" or action == "delete" or action == "pause" or action == "resume")
    or not valid_rate or not valid_burst or not valid_limits or not ARGV[5] then
  return redis.error_reply("ERR redis_throttle: set_limit takes an action (set, delete, pause, "
    .. "resume), a rate > 0 (at least one per 1e14 µs) or -, an integer burst >= 1 or -, a "
    .. "channel, a name and at most " .. MAX_LIMITS .. " more limits with a rate (a sliding "
    .. "window's count at most " .. MAX_SLIDING_COUNT .. "); got " .. table.concat(ARGV, " "))
end

local now = server_now()

local tat, _, live_rate, live_burst, paused, live_limits = bucket_read(KEYS[1], now)
-- Read before anything is written: a key of another type (WRONGTYPE) fails the call whole.
local paused_until = time_read(redis.call("HGET", KEYS[2], "until"), now) or 0
local _, voided_until = voiding_read(KEYS[3], now)
voided_until = voided_until or 0
if not live_rate then  -- no live limit yet
  live_rate, live_burst, paused, live_limits = "-", "-", "0", ""
end

if action == "set" then
  live_rate, live_burst, live_limits = rate, burst, limits
elseif action == "delete" then
  live_rate, live_burst, paused, live_limits = "-", "-", "0", ""
else
  paused = action == "pause" and "1" or "0"
end
local live = ""
if live_rate ~= "-" or live_burst ~= "-" or paused ~= "0" then
  live = " " .. live_rate .. " " .. live_burst .. " " .. paused
    .. (live_limits ~= "" and " " .. live_limits or "")
end

local void = 0
if tat and tat > now and action ~= "resume" then
  -- Nothing is reserved while paused: a resume voids nothing.
  void = math.ceil(tat - now)
  tat = math.max(now, paused_until)
end
if live ~= "" then
  redis.call("SET", KEYS[1], string.format("%d", tat or now) .. live)
elseif tat and tat > now then
  redis.call("SET", KEYS[1], string.format("%d", tat), "PX", math.ceil((tat - now) / 1000))
else
  redis.call("DEL", KEYS[1])
end
if void > 0 then
  -- Kept for the workers that were not subscribed when it was published (see voided.lua).
  voided_until = math.max(now + void, voided_until)
  redis.call("SET", KEYS[3], string.format("%d %d", now, voided_until),
    "PX", math.ceil((voided_until - now) / 1000))
  redis.call("PUBLISH", ARGV[4], string.format("v%d %d", void, now) .. " " .. ARGV[5])
end
return {string.sub(live, 2), void}
