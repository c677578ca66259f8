#!lua flags=no-writes
-- (Run as scripts.load_script gives it: with lua/prelude.lua, which it uses, put in after this line.)
-- Only reads: it runs on a read-only replica, and in a Redis out of memory, too.
-- When a domain's reserved moments were last voided, for a worker that may have missed the
-- message: penalty.lua, slow_down.lua and set_limit.lua publish each pause (or change of rate)
-- on the fleet's channel, and Redis delivers it only to the workers subscribed at that moment.
-- They also keep it in the domain's void key, "<voided_at> <voided_until>" (µs like the
-- bucket's time, see token_bucket.lua): the moments up to voided_until that were reserved
-- before voided_at are void. A later voiding keeps the latest voided_until of the two, so that
-- this errs on the polite side: a moment reserved between them and after the later one's end
-- is taken as void too (its request asks again).
--
-- KEYS[1]  the domain's void key
--
-- Returns {} when nothing is voided now, else {age_us, left_us, voided_at}: how long ago the
-- last voiding was, how long until the voided moments end, and when it was (µs like the
-- bucket's time: a moment reserved before it, by token_bucket.lua's clock, is void; integers).

local now = server_now()
local voided_at, voided_until = voiding_read(KEYS[1], now)
if not voided_at or not voided_until then
  return {}  -- none, or not ours: nothing to read
end
if voided_until <= now then
  return {}
end
return {math.max(0, now - voided_at), voided_until - now, voided_at}
