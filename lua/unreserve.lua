#!lua
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- The shebang (Redis 7) declares a script that may write: a read-only replica or a Redis out of
-- memory refuses every call up front, not only the calls that happen to write.
-- Give a domain's bucket back moments a worker reserved (token_bucket.lua's status 2) and will
-- not use: at a clean close, the requests holding them are dropped or parked again to ask
-- anew. The next requests get those moments instead of waiting behind them: a fleet restarted
-- after a close does not start behind its budget.
--
-- The bucket's state is one time, TAT (see token_bucket.lua): a reservation moved it from
-- "before" to "after" (after = before + step). Only the last reservation can be taken out
-- (TAT = after: TAT becomes before); taking one out of the middle would let a new request
-- share the moment of one reserved after it. So a reservation that is not the last is set
-- aside in KEYS[2], and taken out when every one after it has been (by this call or a later
-- one, of any worker), or forgotten when the bucket is full again.
--
-- A voiding (a limit set live, an adaptive decrease: see voided.lua) moves the bucket's time
-- anew; a reservation made before it may share its "after" with one made since, and is void
-- anyway: it is never taken out.
--
-- KEYS[1]  the domain's bucket key
-- KEYS[2]  the domain's reservations set aside: a hash, field "after", value "step at" (µs)
-- KEYS[3]  the domain's void key (see voided.lua)
-- ARGV     triples "after step at" (µs since the epoch, µs, and when Redis reserved it; as
--          token_bucket.lua replied them), at most MAX_RESERVATIONS triples
--
-- Returns {taken out, set aside}: how many reservations (of this call's and of those set
-- aside before) the bucket was given back, and how many of this call's were set aside.

-- Bounds on the work of a call: its arguments, and the reservations it takes out (those set
-- aside are at most the domain's reservations, which the workers bound).
local MAX_RESERVATIONS = 1000
local MAX_TAKEN = 10000
-- µs of doubt, to the polite side: a void key may expire a little before the moments it voids
-- end (PX counts whole ms), and Redis's clock may step back (a failover to a server whose clock
-- is behind): moments less than this ahead are not given back, nor reservations made less than
-- this after a voiding.
local MARGIN = 1000000

local now = server_now()
if #ARGV % 3 ~= 0 or #ARGV > 3 * MAX_RESERVATIONS then
  return redis.error_reply("ERR redis_throttle: unreserve takes at most " .. MAX_RESERVATIONS
    .. " triples of after, step and at, got " .. #ARGV .. " arguments")
end
local voided_at = voiding_read(KEYS[3], now) or -math.huge

-- Whether a reservation may be taken out: made after the last voiding, and not "after" now by
-- a clock that stepped back (numbers, or nil).
local function current(step, at)
  return step and at and at > voided_at + MARGIN and at <= now
end

local given = {}
for index = 1, #ARGV, 3 do
  local after, step, at = tonumber(ARGV[index]), tonumber(ARGV[index + 1]),
    tonumber(ARGV[index + 2])
  -- Whole numbers: the bucket's times are (a field of KEYS[2] is one written with %d).
  if not (after and step and at and after == math.floor(after) and step == math.floor(step)
      and at == math.floor(at) and after < now + MAX_AHEAD and step > 0 and step <= after
      and at >= 0 and at < now + MAX_AHEAD) then  -- (NaN fails too)
    return redis.error_reply("ERR redis_throttle: a reservation is a whole after before now "
      .. "+ 1e15, a whole step > 0, at most after, and a whole time at >= 0, got "
      .. tostring(ARGV[index]) .. " " .. tostring(ARGV[index + 1]) .. " "
      .. tostring(ARGV[index + 2]))
  end
  -- A moment spent (given back or not), or void, is none to give back.
  if after > now + MARGIN and current(step, at) then
    given[after] = {step, at}
  end
end

-- A bucket that is garbage is left alone, and so are the reservations.
local tat, live = bucket_read(KEYS[1], now)

local taken = 0
if tat then
  local from = tat
  for _ = 1, MAX_TAKEN do
    if tat <= now + MARGIN then
      break  -- the bucket is (all but) full: what was reserved before is spent
    end
    local step
    if given[tat] then
      step = given[tat][1]
      given[tat] = nil
    else
      local field = string.format("%d", tat)
      local aside_step, aside_at =
        string.match(redis.call("HGET", KEYS[2], field) or "", "^(%d+) (%d+)$")
      step = number_read(aside_step, tat + 1)
      if not (step and step > 0 and current(step, time_read(aside_at, now))) then
        break  -- none, void, or garbage
      end
      redis.call("HDEL", KEYS[2], field)
    end
    tat = tat - step
    taken = taken + 1
  end
  if tat ~= from then
    if tat <= now and live == "" then
      redis.call("DEL", KEYS[1])  -- full: idle domains vanish, as in token_bucket.lua
    elseif live == "" then
      redis.call("SET", KEYS[1], string.format("%d", tat), "PX", math.ceil((tat - now) / 1000))
    else
      redis.call("SET", KEYS[1], string.format("%d", math.max(tat, now)) .. live)
    end
  end
end

-- What is not the last yet, while the bucket still holds it (below its time: one above was
-- never in it, or is gone).
local set_aside = 0
for after, reservation in pairs(given) do
  if tat and after <= tat then
    redis.call("HSET", KEYS[2], string.format("%d", after),
      string.format("%d %d", reservation[1], reservation[2]))
    set_aside = set_aside + 1
  end
end
if set_aside > 0 then
  -- As long as the bucket holds a moment: every one set aside is below its time (one that
  -- outlives it, a pause having moved the time, is none to take out any more).
  redis.call("PEXPIRE", KEYS[2], math.ceil((tat - now) / 1000))
end
return {taken, set_aside}
